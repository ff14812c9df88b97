import sys

import pytest

from art_mega.errors import ProgramImportError, UserError
from art_mega.launch.program import load_program, parse_program

GOOD = "async def main(launch):\n    return launch\n"


def test_script_reference_puts_its_folder_on_sys_path(tmp_path):
    script = tmp_path / "prog_good.py"
    script.write_text(GOOD)
    ref = parse_program(f"{script}:main")
    assert ref.module == "prog_good" and ref.function == "main"
    assert ref.sys_path == (str(tmp_path),)
    fn = load_program(ref)
    assert fn.__name__ == "main" and fn.__module__ == "prog_good"


def test_module_reference(tmp_module):
    tmp_module("prog_mod_ref", GOOD)
    ref = parse_program("prog_mod_ref:main")
    assert ref.script is None and ref.sys_path == ()
    assert load_program(ref).__module__ == "prog_mod_ref"


@pytest.mark.parametrize(
    "text,message",
    [
        ("examples/multinode/program.py", "has no ':'"),
        (":main", "needs both parts"),
        ("x.py:", "needs both parts"),
        ("does/not/exist.py:main", "does not exist"),
        ("not-a-module:main", "not a module name"),
        ("x.py:1abc", "not a function name"),
    ],
)
def test_bad_references(text, message):
    with pytest.raises(UserError, match=message):
        parse_program(text)


@pytest.mark.parametrize(
    "source,message",
    [
        ("async def other(launch):\n    pass\n", "has no function 'main'"),
        ("def main(launch):\n    pass\n", "async def main"),
        ("async def main():\n    pass\n", "exactly one argument"),
        ("main = 3\n", "top-level function"),
        (
            "def f():\n    async def main(launch):\n        pass\n    return main\nmain = f()\n",
            "top-level function",
        ),
    ],
)
def test_bad_functions(tmp_path, source, message):
    name = f"prog_bad_{abs(hash(source)) % 10**8}"
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    with pytest.raises(UserError, match=message):
        load_program(parse_program(f"{script}:main"))


def test_missing_module():
    with pytest.raises(UserError, match="cannot be found"):
        load_program(parse_program("no_such_module_xyz.sub:main"))


@pytest.mark.parametrize(
    "source,message",
    [("def main(:\n", "prog_syntax_err.py:1"), (b"x = 1\x00\n", "null bytes")],
)
def test_scripts_that_do_not_compile(tmp_path, source, message):
    script = tmp_path / "prog_syntax_err.py"
    script.write_bytes(source if isinstance(source, bytes) else source.encode())
    with pytest.raises(UserError, match=message):
        load_program(parse_program(f"{script}:main"))


def test_a_directory_is_named(tmp_path):
    with pytest.raises(UserError, match="is a directory"):
        parse_program(f"{tmp_path}:main")


@pytest.mark.parametrize(
    "source,cause,message",
    [
        (
            "import no_such_pkg_q\n",
            "ModuleNotFoundError",
            r"failed at .*prog_imp_fail\.py:1: module 'no_such_pkg_q' is not",
        ),
        ("x = {}['k']\n", "KeyError", r"raised KeyError: 'k' at .*prog_imp_fail\.py:1; fix the module's"),
        ("raise SystemError('a\\n\\nb')\n", "SystemError", r"raised SystemError: a b at "),
    ],
)
def test_import_failures_name_the_module_and_the_cause(tmp_path, source, cause, message):
    script = tmp_path / "prog_imp_fail.py"
    script.write_text(source)
    with pytest.raises(ProgramImportError, match=message) as info:
        load_program(parse_program(f"{script}:main"))
    assert (info.value.module, info.value.cause) == ("prog_imp_fail", cause)
    assert type(info.value.__cause__).__name__ == cause
    assert "\n" not in str(info.value)
    sys.modules.pop("prog_imp_fail", None)
