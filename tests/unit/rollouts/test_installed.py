import importlib

import pytest

from art_mega.errors import UserError
from art_mega.rollouts.installed import InstalledAsyncCallable

SOURCE = "async def rollout(x):\n    return x + 1\n\ndef plain(x):\n    return x\n\ndef outer():\n    async def inner():\n        return 1\n    return inner\n"


def test_records_module_qualname_and_hash(tmp_module):
    path = tmp_module("inst_mod_a", SOURCE)
    mod = importlib.import_module("inst_mod_a")
    installed = InstalledAsyncCallable.from_callable(mod.rollout)
    import hashlib

    assert installed.module == "inst_mod_a"
    assert installed.qualname == "rollout"
    assert installed.source_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert installed.load() is mod.rollout


def test_refuses_lambda_closure_and_sync(tmp_module):
    tmp_module("inst_mod_b", SOURCE)
    mod = importlib.import_module("inst_mod_b")
    with pytest.raises(UserError, match="lambda"):
        InstalledAsyncCallable.from_callable(lambda x: x)
    with pytest.raises(UserError, match="inside another function"):
        InstalledAsyncCallable.from_callable(mod.outer())
    with pytest.raises(UserError, match="not an async function"):
        InstalledAsyncCallable.from_callable(mod.plain)
    with pytest.raises(UserError, match="not a function"):
        InstalledAsyncCallable.from_callable(3)


def test_edited_source_is_refused(tmp_module):
    path = tmp_module("inst_mod_c", SOURCE)
    mod = importlib.import_module("inst_mod_c")
    installed = InstalledAsyncCallable.from_callable(mod.rollout)
    assert installed.load() is mod.rollout  # as a worker: import, hash fixed
    path.write_text(SOURCE + "\n# edited\n")
    rehashed = InstalledAsyncCallable.from_callable(mod.rollout)
    assert rehashed.source_sha256 != installed.source_sha256
    with pytest.raises(UserError, match="changed after the controller hashed it"):
        rehashed.load()
    # this process still runs the source it imported: the original hash stays the valid one
    assert installed.load() is mod.rollout


def test_missing_name_is_refused(tmp_module):
    tmp_module("inst_mod_d", SOURCE)
    mod = importlib.import_module("inst_mod_d")
    good = InstalledAsyncCallable.from_callable(mod.rollout)
    with pytest.raises(UserError, match="does not exist"):
        InstalledAsyncCallable(good.module, "nope", good.source_sha256).load()
