"""The package's import graph, read with `ast` (no module is imported): its layers hold.

Low to high: errors, hyperparams < topology < agent (the server framework, its client and the
agent's own bodies) < the services (preflight, rollouts, transfer, inference, trainer) < runtime <
launch < backend. Every import counts, at module level or inside a function, under
`TYPE_CHECKING` too: a function-level import is a dependency that only waits for its first call.
A "package" is a top-level subpackage or top-level module of art_mega (`art_mega.agent`,
`art_mega.gather`); the root `art_mega/__init__.py` names its exports as strings only.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

SERVICES = ("preflight", "rollouts", "transfer", "inference", "trainer")
AGENT_PUBLIC = ("routes", "supervisor", "client", "protocol", "ports")
"""The agent modules a service may import (not app, listeners, lease, auth: the agent's insides)."""
ABOVE_AGENT = (*SERVICES, "runtime", "launch", "backend")
RANK = "art_mega.trainer.rank"
"""The trainer rank's own package: only the rank process imports it."""
RANK_SIDE_FUNCTIONS = ("art_mega.trainer.families", "art_mega.trainer.peft_io")
"""Shared modules with rank-side functions, which may import the rank's modules inside those
functions only: a family file holds its spec (read by the controller and the rank) and its layer
builders; peft_io, the owner of the PEFT adapter format, its torch-free layout (the controller's
warm-start check) and the rank's export and import."""
PREPARE = "art_mega.trainer.prepare"
"""Controller-side preparation of a step (tokenize, advantages, memory plan): no rank imports it."""
BACKEND_IMPORTERS = ("art_mega.local.backend",)
"""The modules that may import art_mega.backend: `art_mega.local.backend` is ART's `LocalBackend` for
it. (The root `__init__` exports it by name, importing it on first use.)"""


@dataclass(frozen=True)
class Import:
    """Module `importer` (in `path`, at `line`) imports module `imported`."""

    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.importer} ({self.path}:{self.line}) imports {self.imported}"


def module_name(path: Path, top: Path) -> str:
    """`pkg/sub/mod.py` -> "pkg.sub.mod", `pkg/sub/__init__.py` -> "pkg.sub"; `top` holds `pkg`."""
    parts = list(path.relative_to(top).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path) -> list[Import]:
    """Every import of a module of the package at `package_dir` by one of its modules, once per
    statement.

    `from X import name` is an import of module `X.name` when that is a module of the package,
    else of `X`; relative imports are resolved; imports of other packages are left out.
    """
    top = package_dir.parent
    root = package_dir.name
    paths = {module_name(p, top): p for p in sorted(package_dir.rglob("*.py"))}
    imports: dict[Import, None] = {}
    for importer, path in paths.items():
        shown = path.relative_to(top)
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = importer.split(".")[: None if is_package else -1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in paths else source
                    for alias in node.names
                ]
            for target in targets:
                if target == root or target.startswith(root + "."):
                    imports[Import(importer, target, shown, node.lineno)] = None
    return list(imports)


def package_of(module: str) -> str:
    """ "art_mega.agent.client" -> "agent", "art_mega.gather" -> "gather", "art_mega" -> "art_mega"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_cycles(imports: list[Import]) -> list[list[str]]:
    """The sets of packages that import each other in a circle (strongly connected components of
    more than one package, Tarjan's algorithm), each sorted."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        a, b = package_of(imp.importer), package_of(imp.imported)
        if a != b:
            edges[a].add(b)
            edges[b]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def describe_cycles(imports: list[Import], cycles: list[list[str]]) -> str:
    """Each cycle with the imports that close it, one per line."""
    lines = []
    for cycle in cycles:
        lines.append(f"packages {', '.join(cycle)} import each other:")
        lines += [
            f"  {imp}"
            for imp in imports
            if package_of(imp.importer) in cycle
            and package_of(imp.imported) in cycle
            and package_of(imp.importer) != package_of(imp.imported)
        ]
    return "\n".join(lines)


IMPORTS = import_graph(REPO / "art_mega")


def _from(package: str) -> list[Import]:
    return [imp for imp in IMPORTS if package_of(imp.importer) == package]


def test_no_two_packages_import_each_other_even_through_others():
    cycles = package_cycles(IMPORTS)
    assert cycles == [], describe_cycles(IMPORTS, cycles)


def test_topology_imports_nothing_of_art_mega_but_errors():
    wrong = [imp for imp in _from("topology") if package_of(imp.imported) not in ("topology", "errors")]
    assert wrong == [], "topology/ may import only art_mega.errors:\n" + "\n".join(map(str, wrong))


def test_the_agent_imports_no_service():
    wrong = [imp for imp in _from("agent") if package_of(imp.imported) in ABOVE_AGENT]
    assert wrong == [], "agent/ imports no service (services register with it):\n" + "\n".join(
        map(str, wrong)
    )


def test_services_import_only_the_agents_public_modules():
    public = {f"art_mega.agent.{name}" for name in AGENT_PUBLIC}
    wrong = [
        imp
        for service in SERVICES
        for imp in _from(service)
        if package_of(imp.imported) == "agent" and imp.imported not in public
    ]
    assert wrong == [], f"a service imports from agent/ only {', '.join(AGENT_PUBLIC)}:\n" + "\n".join(
        map(str, wrong)
    )


def test_nothing_below_the_backend_imports_it():
    wrong = [
        imp
        for imp in IMPORTS
        if _within(imp.imported, "art_mega.backend")
        and not _within(imp.importer, "art_mega.backend")
        and imp.importer not in BACKEND_IMPORTERS
    ]
    assert wrong == [], "only art_mega.local.backend may import art_mega.backend:\n" + "\n".join(map(str, wrong))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_level_imports(path: Path) -> set[int]:
    """The line numbers of the imports of the module at `path` that run at its import (outside
    every function and every `if TYPE_CHECKING:` block)."""
    tree = ast.parse(path.read_text(), str(path))
    inside: set[int] = set()
    for node in ast.walk(tree):
        checking = isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        if checking or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return {
        n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno not in inside
    }


def test_nothing_outside_the_rank_imports_the_rank_package():
    wrong = []
    for imp in IMPORTS:
        if not _within(imp.imported, RANK) or _within(imp.importer, RANK):
            continue
        shared = any(_within(imp.importer, module) for module in RANK_SIDE_FUNCTIONS)
        if shared and imp.line not in _module_level_imports(REPO / imp.path):
            continue
        wrong.append(imp)
    assert wrong == [], f"only the rank ({RANK}) imports {RANK}; a shared module only inside a function:\n" + (
        "\n".join(map(str, wrong))
    )


def test_the_rank_imports_no_controller_or_agent_module():
    controller = (PREPARE, "art_mega.trainer.remote", "art_mega.trainer.routes", "art_mega.backend")
    wrong = [
        imp
        for imp in IMPORTS
        if _within(imp.importer, RANK) and any(_within(imp.imported, side) for side in controller)
    ]
    assert wrong == [], "a rank imports neither the controller's nor the agent's modules:\n" + "\n".join(
        map(str, wrong)
    )


def test_the_detector_finds_a_cycle_through_a_function_level_and_a_relative_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "b").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b" / "__init__.py").write_text("def thing():\n    from ..c import other\n    return other\n")
    (package / "c.py").write_text("import os\n\n\ndef other():\n    from pkg import a\n    return a\n")
    (package / "d.py").write_text("from . import c\n")
    imports = import_graph(package)
    assert {(i.importer, i.imported, i.line) for i in imports} == {
        ("pkg.a", "pkg.b", 1),
        ("pkg.b", "pkg.c", 2),
        ("pkg.c", "pkg.a", 5),
        ("pkg.d", "pkg.c", 1),
    }
    cycles = package_cycles(imports)
    assert cycles == [["a", "b", "c"]]
    assert "pkg.c (pkg/c.py:5) imports pkg.a" in describe_cycles(imports, cycles)
    (package / "c.py").write_text("def other():\n    return 1\n")
    assert package_cycles(import_graph(package)) == []
