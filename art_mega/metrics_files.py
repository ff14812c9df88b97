"""ART's per-step trajectory files: `model.log` writes the groups of each call to
`<run dir>/trajectories/<split>/<step:04d>.parquet` (ZSTD), one row per trajectory, in ART
0.5.18's schema, so ART's readers and its duckdb/polars queries read art-mega runs.

Columns: group_index, group_metadata / group_metrics (JSON or null), group_logs, reward, metrics /
metadata / tools (JSON or null), logs, messages (role, content, tool_calls as JSON, tool_call_id,
trainable: True for a sampled Choice). Exceptions are not rows (as in ART). Needs pyarrow (the
`trajectories` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice

from art_mega.errors import TrainInputError, UserError
from art_mega.trajectories import Trajectory, TrajectoryGroup, value_problem


def trajectory_file(run_dir: Path, split: str, step: int) -> Path:
    """Where `model.log(..., split, step=step)` writes its groups (ART's path)."""
    return run_dir / "trajectories" / split / f"{step:04d}.parquet"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (the submodule the writer and reader use)
    except ImportError:
        raise UserError(
            "model.log writes ART's trajectory files (trajectories/<split>/<step>.parquet), which needs "
            "pyarrow; pip install 'art-mega[trajectories]'"
        ) from None
    return pyarrow


def _text(value: Any) -> str | None:
    """A message content as text: a string as is, content parts (a list) as their JSON."""
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _json(value: Any) -> str | None:
    return json.dumps(value, default=_number) if value else None


def _number(value: Any) -> Any:
    """A numpy scalar (which metrics and metadata accept) as the Python number JSON writes."""
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _message_row(item: Any) -> dict[str, Any]:
    if isinstance(item, Choice):
        message = item.message
        calls = [c.model_dump(mode="json") for c in message.tool_calls or []]
        return {
            "role": message.role,
            "content": message.content,
            "tool_calls": _json(calls),
            "tool_call_id": None,
            "trainable": True,
        }
    return {
        "role": item.get("role"),
        "content": _text(item.get("content")),
        "tool_calls": _json(item.get("tool_calls")),
        "tool_call_id": item.get("tool_call_id"),
        "trainable": False,
    }


def _schema(pa: Any) -> Any:
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("tool_calls", pa.string()),
            ("tool_call_id", pa.string()),
            ("trainable", pa.bool_()),
        ]
    )
    return pa.schema(
        [
            ("group_index", pa.int64()),
            ("group_metadata", pa.string()),
            ("group_metrics", pa.string()),
            ("group_logs", pa.list_(pa.string())),
            ("reward", pa.float64()),
            ("metrics", pa.string()),
            ("metadata", pa.string()),
            ("tools", pa.string()),
            ("logs", pa.list_(pa.string())),
            ("messages", pa.list_(message)),
        ]
    )


def write_trajectory_groups(
    groups: list[TrajectoryGroup], path: Path, where: str = "model.log(trajectories)"
) -> None:
    """Write `groups` to `path` (its folder created) as ART's parquet file, replacing it.

    Raises:
        UserError: pyarrow is not installed (names the extra).
        TrainInputError: a group's or trajectory's metadata or metrics changed since it was
            built to hold a value JSON or the metrics cannot take (`trajectories.value_problem`),
            naming `where`, the group, the trajectory and the key; nothing is written.
    """
    for g, group in enumerate(groups):
        problem = value_problem(group)
        if problem is not None:
            raise TrainInputError(f"{where}: group {g}: {problem[1]}", "trajectories", g, problem[0])
    pa = _pyarrow()
    rows = [
        {
            "group_index": index,
            "group_metadata": _json(group.metadata),
            "group_metrics": _json(group.metrics),
            "group_logs": group.logs or None,
            "reward": trajectory.reward,
            "metrics": _json(trajectory.metrics),
            "metadata": _json(trajectory.metadata),
            "tools": _json(trajectory.tools),
            "logs": trajectory.logs or None,
            "messages": [_message_row(item) for item in trajectory.messages_and_choices],
        }
        for index, group in enumerate(groups)
        for trajectory in group.trajectories
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pa.parquet.write_table(pa.Table.from_pylist(rows, schema=_schema(pa)), path, compression="zstd")


def read_trajectory_groups(path: Path) -> list[TrajectoryGroup]:
    """The groups of a trajectory file, as ART's reader rebuilds them: messages as plain dicts
    (a sampled Choice comes back as an assistant message), group metadata/metrics/logs kept.

    Raises:
        UserError: pyarrow is not installed, or `path` is not a parquet file of this schema.
    """
    pa = _pyarrow()
    try:
        rows = pa.parquet.read_table(path).to_pylist()
    except (OSError, pa.ArrowInvalid) as exc:
        raise UserError(f"{path} is not a readable trajectory parquet file ({exc})") from None
    groups: dict[int, TrajectoryGroup] = {}
    for row in rows:
        index = row["group_index"]
        if index not in groups:
            groups[index] = TrajectoryGroup(
                [],
                metadata=json.loads(row["group_metadata"] or "{}"),
                metrics=json.loads(row["group_metrics"] or "{}"),
                logs=row["group_logs"] or [],
            )
        messages = []
        for m in row["messages"] or []:
            message = {"role": m["role"], "content": m["content"]}
            if m["tool_calls"]:
                message["tool_calls"] = json.loads(m["tool_calls"])
            if m["tool_call_id"]:
                message["tool_call_id"] = m["tool_call_id"]
            messages.append(message)
        groups[index].trajectories.append(
            Trajectory(
                messages_and_choices=messages,
                reward=row["reward"],
                metrics=json.loads(row["metrics"] or "{}"),
                metadata=json.loads(row["metadata"] or "{}"),
                tools=json.loads(row["tools"]) if row["tools"] else None,
                logs=row["logs"] or [],
            )
        )
    return [groups[i] for i in sorted(groups)]
