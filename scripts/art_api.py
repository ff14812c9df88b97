"""Write ART's public API, read with `ast` from an unpacked openpipe-art wheel, as JSON.

    python3.12 scripts/art_api.py /work/ref/art-0.5.23/art > tests/unit/client/data/art_0_5_23_api.json

ART 0.5.20+ uses Python 3.12 syntax (`type X = ...`), so run this with Python >= 3.12; it
imports nothing from ART (no torch, no vllm). The output is committed, so CI needs neither the
wheel nor a download; tests/unit/client/test_art_table.py and test_art_signatures.py read it.

What counts as public is what tests/unit/client/test_art_table.py counted for 0.5.18: the `__all__` of
the packages programs import (`MODULES_ALL`), chosen names of the modules programs import from
(`MODULES_PICKED`), and the public fields and methods of the classes programs use (`CLASSES`).
For every callable among them (a function, a method, a class's constructor) the parameters are
written as `[name, kind, default]`, kind as `inspect.Parameter.kind`'s name, default the
literal value (`{"expr": source}` when it is not a literal, absent when there is none).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

MODULES_ALL = (
    "art",
    "art.dev",
    "art.utils",
    "art.local",
    "art.rewards",
    "art.mcp",
    "art.langgraph",
    "art.serverless",
    "art.pipeline_trainer",
)
MODULES_PICKED = {
    "art.types": (
        "Message", "MessageOrChoice", "Messages", "MessagesAndChoices", "Tools", "TrainConfig",
        "TrainSFTConfig", "Verbosity", "TrainResult", "LocalTrainResult", "ServerlessTrainResult",
    ),
    "art.trajectories": (
        "Trajectory", "TrajectoryGroup", "History", "PydanticException", "trajectory",
        "trajectory_group", "current_trajectory", "no_capture",
    ),
    "art.gather": ("gather_trajectory_groups", "gather_trajectories"),
    "art.local.backend": ("LocalBackend",),
    "art.utils.iterate_dataset": ("iterate_dataset", "DatasetBatch"),
    "art.utils.strip_logprobs": ("strip_logprobs",),
    "art.utils.sft": (
        "SFTChunk", "resolve_sft_batch_size", "get_file_row_count", "create_lr_schedule",
        "create_sft_dataset_iterator", "iterate_file", "train_sft_from_file",
    ),
    "art.metrics": ("MetricsBuilder", "track_api_cost"),
}  # fmt: skip
CLASSES = (
    "art.Model",
    "art.TrainableModel",
    "art.Trajectory",
    "art.TrajectoryGroup",
    "art.TrainConfig",
    "art.TrainSFTConfig",
    "art.TrainResult",
    "art.LocalTrainResult",
    "art.Backend",
    "art.local.LocalBackend",
    "art.dev.InternalModelConfig",
    "art.dev.TrainConfig",
    "art.dev.TrainSFTConfig",
    "art.dev.LoRAConfig",
    "art.metrics.MetricsBuilder",
    "art.pipeline_trainer.PipelineTrainer",
)
PRIVATE_BUT_USED = {"_internal_config", "__init__"} | {
    f"_experimental_{x}" for x in ("pull_from_s3", "push_to_s3", "fork_checkpoint", "pull_model_checkpoint")
}
"""Underscore names ART programs use (`_internal_config=`, `backend._experimental_pull_from_s3`)."""
NOT_MEMBERS = {"model_config", "model_fields", "model_post_init"}
"""pydantic's own class attributes: not ART's API (nor is any other `model_*` method)."""
HOOKS = ("field_serializer", "field_validator", "model_validator", "model_serializer")
"""Decorators of pydantic hooks: methods pydantic calls, not programs."""


class Package:
    """The parsed modules of one unpacked package, by dotted name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> Path | None:
        rel = Path(*module.split(".")[1:])
        for path in (self.root / rel / "__init__.py", self.root / f"{rel}.py"):
            if path.is_file():
                return path
        return None

    def is_module(self, module: str) -> bool:
        return self.file(module) is not None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = ast.parse(path.read_text()) if path else None
        return self._trees[module]

    def statements(self, module: str) -> list[ast.stmt]:
        """Top-level statements, also those inside top-level if/try blocks."""
        tree = self.tree(module)
        out: list[ast.stmt] = []

        def walk(body: list[ast.stmt]) -> None:
            for node in body:
                out.append(node)
                if isinstance(node, ast.If):
                    walk(node.body)
                    walk(node.orelse)
                elif isinstance(node, ast.Try):
                    walk(node.body)
                    for handler in node.handlers:
                        walk(handler.body)

        walk(tree.body if tree else [])
        return out

    def all_of(self, module: str) -> list[str]:
        for node in self.statements(module):
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                return list(ast.literal_eval(node.value))
        raise SystemExit(f"{module} has no __all__")

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, Any]:
        """(module where `name` is defined, its node); a module itself: (dotted name, None)."""
        if depth > 20:
            raise SystemExit(f"import cycle resolving {module}.{name}")
        found: tuple[str, Any] | None = None
        for node in self.statements(module):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = (module, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.TypeAlias)):
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [node.target if not isinstance(node, ast.TypeAlias) else node.name]
                )
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = (module, node)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(module, node)
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        if self.is_module(f"{base}.{alias.name}"):
                            found = (f"{base}.{alias.name}", None)
                        elif base.split(".")[0] == "art":
                            found = self.resolve(base, alias.name, depth + 1)
                        else:
                            found = (base, ("external", alias.name))
        if found is None:
            if self.is_module(f"{module}.{name}"):
                return (f"{module}.{name}", None)
            raise SystemExit(f"cannot resolve {module}.{name}")
        return found

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.file(module).name == "__init__.py" else module.rsplit(".", 1)[0]
        parts = package.split(".")
        parts = parts[: len(parts) - node.level + 1]
        return ".".join(parts + ([node.module] if node.module else []))


def default_of(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return {"expr": ast.unparse(node)}


def params_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool) -> list[list[Any]]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[list[Any]] = []
    for i, arg in enumerate(positional):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([arg.arg, kind] + ([default_of(defaults[i])] if defaults[i] is not None else []))
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL"])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append([arg.arg, "KEYWORD_ONLY"] + ([default_of(default)] if default is not None else []))
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD"])
    if drop_first and out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def is_static(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)


def is_overload(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).endswith("overload") for d in fn.decorator_list)


class Extractor:
    def __init__(self, package: Package) -> None:
        self.pkg = package
        self.names: dict[str, list[str]] = {}
        self.kinds: dict[str, str] = {}
        self.signatures: dict[str, list[list[Any]]] = {}

    def owner_target(self, qualified: str) -> tuple[str, Any]:
        module, _, name = qualified.rpartition(".")
        while not self.pkg.is_module(module):  # art.local.LocalBackend: module art.local
            raise SystemExit(f"{qualified}: owner is not a module")
        return self.pkg.resolve(module, name)

    def add_module_member(self, owner: str, name: str) -> None:
        where, node = self.pkg.resolve(owner, name)
        qualified = f"{owner}.{name}"
        self.names.setdefault(owner, []).append(name)
        if node is None:
            self.kinds[qualified] = "module"
        elif isinstance(node, tuple):
            self.kinds[qualified] = "external"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.kinds[qualified] = "function"
            self.signatures[qualified] = params_of(node, drop_first=False)
        elif isinstance(node, ast.ClassDef):
            self.kinds[qualified] = self.class_kind(where, node)
            init = self.constructor(where, node)
            if init is not None:
                self.signatures[qualified] = init
        else:
            self.kinds[qualified] = "value"

    def bases(self, module: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases defined inside ART, most derived first."""
        out = [(module, node)]
        for base in node.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(expr, ast.Name):
                try:
                    where, found = self.pkg.resolve(module, expr.id)
                except SystemExit:
                    continue
                if isinstance(found, ast.ClassDef):
                    out += self.bases(where, found)
        return out

    def base_names(self, module: str, node: ast.ClassDef) -> set[str]:
        names = set()
        for _where, cls in self.bases(module, node):
            for base in cls.bases:
                names.add(ast.unparse(base.value if isinstance(base, ast.Subscript) else base).split(".")[-1])
        return names

    def class_kind(self, module: str, node: ast.ClassDef) -> str:
        bases = self.base_names(module, node)
        if "TypedDict" in bases:
            return "typeddict"
        if "Protocol" in bases:
            return "protocol"
        if bases & {"BaseModel", "_CompactModel"}:
            return "pydantic"
        if any(
            ast.unparse(d).endswith("dataclass") or "dataclass(" in ast.unparse(d)
            for d in node.decorator_list
        ):
            return "dataclass"
        return "class"

    def fields(self, module: str, node: ast.ClassDef) -> list[tuple[str, ast.AnnAssign]]:
        seen: dict[str, ast.AnnAssign] = {}
        for _, cls in reversed(self.bases(module, node)):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if "ClassVar" in ast.unparse(stmt.annotation):
                        continue
                    seen.pop(stmt.target.id, None)
                    seen[stmt.target.id] = stmt
        return list(seen.items())

    def methods(self, module: str, node: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
        out: dict[str, Any] = {}
        for _, cls in self.bases(module, node):
            for stmt in cls.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_overload(stmt):
                    out.setdefault(stmt.name, stmt)
        return out

    def constructor(self, module: str, node: ast.ClassDef) -> list[list[Any]] | None:
        kind = self.class_kind(module, node)
        init = self.methods(module, node).get("__init__")
        if init is not None and kind != "typeddict":
            return params_of(init, drop_first=True)
        if kind in ("pydantic", "dataclass"):
            out = []
            for name, stmt in self.fields(module, node):
                if name.startswith("_"):
                    continue
                entry: list[Any] = [name, "KEYWORD_ONLY" if kind == "pydantic" else "POSITIONAL_OR_KEYWORD"]
                if stmt.value is not None:
                    value = stmt.value
                    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("Field"):
                        kw = {k.arg: k.value for k in value.keywords}
                        if "default" in kw:
                            entry.append(default_of(kw["default"]))
                        elif value.args:
                            entry.append(default_of(value.args[0]))
                        elif "default_factory" in kw:
                            entry.append({"expr": f"{ast.unparse(kw['default_factory'])}()"})
                    else:
                        entry.append(default_of(value))
                out.append(entry)
            return out
        return None

    def add_class_members(self, qualified: str) -> None:
        module, node = self.owner_target(qualified)
        assert isinstance(node, ast.ClassDef), qualified
        kind = self.class_kind(module, node)
        members = self.names.setdefault(qualified, [])
        for name, _ in self.fields(module, node):
            if (not name.startswith("_") or name in PRIVATE_BUT_USED) and name not in NOT_MEMBERS:
                members.append(name)
                self.kinds[f"{qualified}.{name}"] = "field" if kind != "typeddict" else "key"
        if kind == "typeddict":
            return
        for name, fn in self.methods(module, node).items():
            if (
                name.startswith("_")
                and name not in PRIVATE_BUT_USED
                or name in NOT_MEMBERS
                or name == "__init__"
            ):
                continue
            if name.startswith("model_") or any(
                h in ast.unparse(d) for d in fn.decorator_list for h in HOOKS
            ):
                continue
            if name in members:
                continue
            members.append(name)
            decorators = {ast.unparse(d) for d in fn.decorator_list}
            member = f"{qualified}.{name}"
            if (
                "property" in decorators
                or "cached_property" in decorators
                or any(d.endswith(".setter") for d in decorators)
            ):
                self.kinds[member] = "property"
                continue
            self.kinds[member] = "async method" if isinstance(fn, ast.AsyncFunctionDef) else "method"
            self.signatures[member] = params_of(fn, drop_first=not is_static(fn))

    def run(self, version: str) -> dict[str, Any]:
        for module in MODULES_ALL:
            for name in self.pkg.all_of(module):
                self.add_module_member(module, name)
        for module, names in MODULES_PICKED.items():
            for name in names:
                self.add_module_member(module, name)
        for cls in CLASSES:
            self.add_class_members(cls)
        return {
            "version": version,
            "generated_by": "scripts/art_api.py",
            "names": self.names,
            "kinds": dict(sorted(self.kinds.items())),
            "signatures": dict(sorted(self.signatures.items())),
        }


def main() -> None:
    root = Path(sys.argv[1])
    version = sys.argv[2] if len(sys.argv) > 2 else root.parent.name.removeprefix("art-")
    json.dump(Extractor(Package(root)).run(version), sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
