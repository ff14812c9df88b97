"""The rollout worker's per-call parsing: validated CallableRefs cached by their raw form."""

import pydantic
import pytest

from art_mega.rollouts.protocol import CallableRef
from art_mega.rollouts.worker import MAX_CACHED_REFS, _Worker

RAW = {"module": "m", "qualname": "f", "source_sha256": "a" * 64}


def test_a_raw_ref_is_validated_once_and_reused():
    worker = _Worker(writer=None)  # type: ignore[arg-type]
    ref = worker._ref(dict(RAW))
    assert ref == CallableRef(**RAW)
    assert worker._ref(dict(RAW)) is ref
    assert worker._ref({**RAW, "qualname": "g"}).qualname == "g"


@pytest.mark.parametrize(
    "raw",
    [
        {**RAW, "extra": 1},
        {"module": "m", "qualname": "f"},
        {**RAW, "module": ["unhashable"]},
        ["not", "a", "dict"],
        None,
    ],
)
def test_bad_raw_refs_are_refused_every_time(raw):
    worker = _Worker(writer=None)  # type: ignore[arg-type]
    worker._ref(dict(RAW))
    for _ in range(2):
        with pytest.raises(pydantic.ValidationError):
            worker._ref(raw)
    assert len(worker._refs) == 1


def test_the_cache_is_bounded():
    worker = _Worker(writer=None)  # type: ignore[arg-type]
    for i in range(MAX_CACHED_REFS + 5):
        assert worker._ref({**RAW, "qualname": f"f{i}"}).qualname == f"f{i}"
    assert len(worker._refs) == MAX_CACHED_REFS


def test_a_refused_value_is_a_user_failure_without_a_traceback():
    from art_mega.rollouts.worker import _ValueRefused, failure_from

    failure = failure_from(_ValueRefused("returned a value that cannot travel: result is bytes, ..."))
    assert (failure.kind, failure.exc_type, failure.traceback) == ("user", "WireError", "")
    assert failure.message == "returned a value that cannot travel: result is bytes, ..."
    assert failure_from(ValueError("boom")).kind == "error"
