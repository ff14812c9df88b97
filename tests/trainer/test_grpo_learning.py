"""GRPO learns (issue 6): with a reward preferring one of four candidate completions and groups
sampled from the model's own distribution over them, 20 steps raise the preferred completion's
probability to at least 3x its start, under TP=2 as under TP=1."""

from __future__ import annotations

from tests.trainer.common import require_trainer_deps

require_trainer_deps()


def test_grpo_raises_the_preferred_completion(tp1_engine: dict, tp2_engine: list[dict]) -> None:
    runs = {
        "tp1": tp1_engine["learning"],
        **{f"tp2 rank {r}": res["tp2"]["learning"] for r, res in enumerate(tp2_engine)},
    }
    for label, run in runs.items():
        share, absolute = run["normalised"], run["absolute"]
        print(
            f"{label}: preferred candidate {run['preferred']}; share of the four "
            + " ".join(f"{p:.3f}" for p in share)
        )
        print(f"{label}: absolute probability {absolute[0]:.3e} -> {absolute[-1]:.3e}")
        assert len(share) == 21
        assert share[0] < 1 / 3, "the preferred candidate must start below a third"
        assert share[-1] >= 3 * share[0]
        assert absolute[-1] >= 3 * absolute[0]
    ranks = [res["tp2"]["learning"] for res in tp2_engine]
    assert ranks[0]["picks"] == ranks[1]["picks"], "TP ranks must sample the same groups"
    assert ranks[0]["preferred"] == tp1_engine["learning"]["preferred"]
