"""A program that calls sys.exit at import is named at its own line even when a library has
replaced `sys.exit` with a wrapper (wandb's exit hook does, once a run is initialised)."""

from __future__ import annotations

import sys

import pytest

from art_mega.errors import ProgramImportError
from art_mega.launch.program import load_program, parse_program


class ExitHook:
    """What wandb's `ExitHooks.hook` installs: a bound method that records the code and calls
    the original `sys.exit`."""

    def __init__(self) -> None:
        self.original = sys.exit
        self.code: object = None

    def exit(self, code: object = 0) -> None:
        self.code = code
        self.original(code)


def test_sys_exit_under_a_wrapper_is_named_at_the_programs_line(tmp_path, monkeypatch):
    hook = ExitHook()
    monkeypatch.setattr(sys, "exit", hook.exit)
    path = tmp_path / "wrapped_exit.py"
    path.write_text("import sys\n\nsys.exit('bye')\n")
    with pytest.raises(ProgramImportError) as raised:
        load_program(parse_program(f"{path}:main"))
    assert hook.code == "bye"
    assert f"called sys.exit('bye') at {path}:3, so main would never run" in str(raised.value)
