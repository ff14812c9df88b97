import numpy as np
import pytest

from art_mega.trainer.batch import Document, TrainBatch, pack


def doc(n, advantage=1.0, first=1):
    return Document(
        input_ids=list(range(first, first + n)),
        loss_mask=[0.0] + [1.0] * (n - 1),
        old_logprobs=[0.0] + [-0.5] * (n - 1),
        advantage=advantage,
        weight=1.0 / (n - 1),
    )


def test_pack_respects_documents_and_balances_ranks():
    docs = [doc(6, first=10), doc(3, first=20), doc(4, first=30), doc(2, first=40), doc(5, first=50)]
    batches = pack(docs, seq_len=8, dp_size=2)
    assert len(batches) == 2 and batches[0].shape == batches[1].shape
    tokens = [int((b.segment_ids > 0).sum()) for b in batches]
    assert sum(tokens) == 20 and abs(tokens[0] - tokens[1]) <= 6
    for batch in batches:
        for row in range(batch.shape[0]):
            segments = batch.segment_ids[row]
            for s in set(segments.tolist()) - {0}:
                where = np.nonzero(segments == s)[0]
                assert (np.diff(where) == 1).all()  # contiguous
                assert batch.position_ids[row, where].tolist() == list(range(len(where)))
                assert batch.loss_mask[row, where[0]] == 0.0  # each document's first token is context
                assert (batch.advantages[row, where][1:] == 1.0).all()
    assert sorted(int(v) for b in batches for v in b.input_ids[b.segment_ids > 0]) == sorted(
        t for d in docs for t in d.input_ids
    )


def test_padding_is_never_trained_and_round_trips(tmp_path):
    (batch,) = pack([doc(3), doc(2, advantage=-1.0)], seq_len=8)
    assert batch.shape == (1, 8)
    assert batch.segment_ids[0].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 0, 1, 0, 0, 0]
    assert batch.advantages[0].tolist() == [0, 1, 1, 0, -1, 0, 0, 0]
    assert batch.weights[0].tolist() == pytest.approx([0, 0.5, 0.5, 0, 1, 0, 0, 0])
    batch.save(tmp_path / "b.safetensors")
    back = TrainBatch.load(tmp_path / "b.safetensors")
    assert all((getattr(back, f) == getattr(batch, f)).all() for f in ("input_ids", "segment_ids", "weights"))
    assert back.input_ids.dtype == np.int64 and back.segment_ids.dtype == np.int32


def test_too_long_and_bad_shapes():
    with pytest.raises(ValueError, match="does not fit seq_len=4"):
        pack([doc(5)], seq_len=4)
    with pytest.raises(ValueError, match="TrainBatch.weights has shape"):
        z = np.zeros((1, 4))
        TrainBatch(z.astype(np.int64), z.astype(np.int32), z.astype(np.int64), z, z, z, np.zeros((1, 3)))
