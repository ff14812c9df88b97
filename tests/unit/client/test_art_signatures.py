"""Every public callable of ART 0.5.23 that art-mega provides takes ART's parameters: the same
names in the same order, of the same kinds, with the same defaults (`inspect.signature` of ours
against tests/unit/client/data/art_0_5_23_api.json, which scripts/art_api.py wrote from the 0.5.23
wheel with `ast`; no download, no import of ART).

The rule, per ART callable (a function, a method, a class's constructor; a pydantic model's
constructor is its fields, keyword-only):
- ART's positional parameters are ours, at the same positions, of the same kind;
- ART's keyword-only parameters are keyword-only in ours (their order does not matter to a
  caller);
- a literal default of ART's is ours (==, and a bool stays a bool; for ART's `()` / `[]` ours
  may be any empty sequence or None), one with a non-literal default (`Field(default_factory=...)`)
  has one in ours (a default of ours where ART has none binds every ART call);
- ART's private parameters (a leading underscore) are not its API, except `_internal_config` and
  `_config`, which ART's programs pass;
- ART's `*args` / `**kwargs` are not required of ours (art-mega names what it takes);
- every parameter art-mega adds has a default (or is `*args` / `**kwargs`), so ART's calls bind;
- an async function or method of ART's is async in ours.
`ALLOWED` lists the documented differences, each with its reason. Callables art-mega does not
provide are checked by test_art_table.py (docs/art-compatibility.md marks them "not supported") and
test_art_0_5_23.py (their sentence).
"""

from __future__ import annotations

import importlib
import inspect
import json
import types
from pathlib import Path
from typing import Any

import pytest

from tests.unit.client.test_art_table import member

API = json.loads((Path(__file__).parent / "data" / "art_0_5_23_api.json").read_text())
POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
VARIADIC = ("VAR_POSITIONAL", "VAR_KEYWORD")

ALLOWED: dict[str, str] = {
    "art.local.LocalBackend.train:logprob_calculation_chunk_size": "default None: whole rows (ART 1024); the same values",
    **{
        f"art.local.LocalBackend.train:{name}": "taken by **unknown, refused unless at ART's off value (ART_OPTION_HINTS)"
        for name in ("loss_fn_config", "adam_params", "plot_tensors", "scale_learning_rate_by_reward_std_dev",
                     "save_checkpoint", "verbose")
    },
    "art.trajectories.History": "art-mega's History is ART's LegacyHistory (0.5.18's History); 0.5.23's is a per-model view",
    **{
        f"art.mcp.{name}": "pydantic models (keyword arguments); ART's dataclasses also take them positionally"
        for name in ("MCPTool", "MCPResource", "GeneratedScenario")
    },
    "art.langgraph.init_chat_model:invoke_timeout": "ChatOpenAI's own `timeout=` (in kwargs) bounds each call",
    "art.metrics.MetricsBuilder.add_data:step_rollout_tokens": "0.5.18's name step_actor_tokens (metric data/step_actor_tokens)",
    "art.metrics.MetricsBuilder.add_user_timing:step_rollout_s": "0.5.18's name step_actor_s (metric time/step_actor_s)",
    "art.metrics.MetricsBuilder.add_idle_times:step_rollout_idle_s": "0.5.18's name step_actor_idle_s",
    "art.local.LocalBackend:enable_expert_replay": "LocalBackend's placement flags are issue 30 point 3 (settings)",
    "art.local.backend.LocalBackend:enable_expert_replay": "LocalBackend's placement flags are issue 30 point 3 (settings)",
}  # fmt: skip
"""`qualified` or `qualified:parameter` -> why ours differs from ART 0.5.23's."""


def resolve(qualified: str) -> Any:
    """The art_mega object ART's `qualified` names, by attribute first (`art.utils.retry` is the
    function, as in ART, though `art_mega.utils.retry` is also a module), then by module import,
    then as a class's field (`test_art_table.member`).

    Raises:
        AttributeError or ImportError (UnsupportedNameError): art_mega lacks it.
    """
    obj: Any = importlib.import_module("art_mega")
    for part in qualified.split(".")[1:]:
        try:
            obj = member(obj, part)
        except AttributeError:
            if not isinstance(obj, types.ModuleType):
                raise
            obj = importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def our_params(obj: Any) -> tuple[list[inspect.Parameter], bool]:
    """(the parameters a caller passes to `obj`, whether it is async): a function's or method's
    without `self`/`cls`; a pydantic model's fields (keyword-only; private attributes its
    `__init__` names too); a class's `__init__`'s."""
    if isinstance(obj, type) and hasattr(obj, "model_fields") and not _named_init(obj):
        params = []
        init = inspect.signature(obj.__init__).parameters
        for name, field in obj.model_fields.items():
            default = (
                inspect.Parameter.empty
                if field.is_required()
                else field.get_default(call_default_factory=True)
            )
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
        for name, p in init.items():
            if name not in ("self", *obj.model_fields) and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        return params, False
    target = obj.__init__ if isinstance(obj, type) else obj
    params = list(inspect.signature(target).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    inner = inspect.unwrap(target)  # an @asynccontextmanager's generator
    return params, inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)


def _named_init(cls: type) -> bool:
    """True when art-mega's pydantic class has its own `__init__` that names positional
    parameters (`TrajectoryGroup(trajectories, ...)`): its signature is the constructor's."""
    init = next((vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c)), None)
    if init is None or not getattr(init, "__module__", "").startswith("art_mega"):
        return False
    return any(p.kind.name in POSITIONAL for p in list(inspect.signature(init).parameters.values())[1:])


def _same_default(art: Any, ours: Any) -> bool:
    """ART's default (JSON: a literal, [] for a tuple, {"expr": source} when not a literal) is ours."""
    if ours is inspect.Parameter.empty:
        return False
    if isinstance(art, dict) and set(art) == {"expr"}:
        return True
    if isinstance(art, list):
        return (isinstance(ours, (list, tuple)) and list(ours) == art) or (art == [] and ours is None)
    if isinstance(art, bool) or isinstance(ours, bool):
        return type(art) is type(ours) and art == ours
    return art == ours


def problems(qualified: str, art_params: list[list[Any]], kind: str) -> list[str]:
    """What in ours breaks the module docstring's rule for `qualified`."""
    obj = resolve(qualified)
    params, is_async = our_params(obj)
    by_name = {p.name: (i, p) for i, p in enumerate(params)}
    out = []
    if qualified in ALLOWED:
        return []
    if kind.startswith("async") and not is_async:
        out.append(f"{qualified}: ART's is async, ours is not")
    art_names = set()
    for position, (name, art_kind, *default) in enumerate(art_params):
        if art_kind in VARIADIC or (name.startswith("_") and name not in ("_internal_config", "_config")):
            continue
        art_names.add(name)
        where = f"{qualified}:{name}"
        if where in ALLOWED:
            continue
        if name not in by_name:
            out.append(f"{where}: missing")
            continue
        index, mine = by_name[name]
        if art_kind in POSITIONAL and (index != position or mine.kind.name not in POSITIONAL):
            out.append(f"{where}: ART's positional #{position}, ours #{index} {mine.kind.name}")
        if art_kind == "KEYWORD_ONLY" and mine.kind.name != "KEYWORD_ONLY":
            out.append(f"{where}: ART's keyword-only, ours {mine.kind.name}")
        if default and not _same_default(default[0], mine.default):
            out.append(f"{where}: default ART {default[0]!r}, ours {mine.default!r}")
    for p in params:
        if p.name not in art_names and p.kind.name not in VARIADIC and p.default is inspect.Parameter.empty:
            if f"{qualified}:{p.name}" not in ALLOWED:
                out.append(f"{qualified}:{p.name}: art-mega's own parameter has no default")
    return out


def provided(qualified: str) -> bool:
    try:
        resolve(qualified)
    except (AttributeError, ImportError):  # UnsupportedNameError is an ImportError
        return False
    return True


CALLABLES = sorted(q for q in API["signatures"] if provided(q))


@pytest.mark.parametrize("qualified", CALLABLES)
def test_signature_matches_arts(qualified: str) -> None:
    assert problems(qualified, API["signatures"][qualified], API["kinds"].get(qualified, "")) == []


def test_the_allow_list_names_only_real_parameters() -> None:
    stale = []
    for key in ALLOWED:
        qualified, _, name = key.partition(":")
        params = API["signatures"].get(qualified)
        if params is None or (name and name not in [p[0] for p in params]):
            stale.append(key)
    assert stale == []


def coverage() -> tuple[int, int]:
    """(ART 0.5.23 names, members and parameters art-mega has; all of them): a name or member
    counts when it resolves in art_mega, a parameter when our callable takes it by name."""
    have = total = 0
    for owner, members in API["names"].items():
        for name in members:
            total += 1
            have += provided(f"{owner}.{name}")
    for qualified, params in API["signatures"].items():
        named = [p for p in params if p[1] not in VARIADIC]
        total += len(named)
        if provided(qualified):
            ours = {p.name for p in our_params(resolve(qualified))[0]}
            have += sum(p[0] in ours for p in named)
    return have, total


def test_coverage_of_arts_0_5_23_surface() -> None:
    have, total = coverage()
    assert total == 1015
    # before issue 30: 558 (55%); the rest is mostly what docs/art-compatibility.md marks "not supported"
    assert have >= 656, f"art-mega has {have} of ART 0.5.23's {total} names, members and parameters"
