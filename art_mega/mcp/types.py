"""ART's `art.mcp.types`: an MCP server's tools and resources, and the training scenarios
generated from them (`MCPTool`, `MCPResource`, `GeneratedScenario`,
`GeneratedScenarioCollection`)."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from art_mega.errors import HyperParameterError, UserError
from art_mega.hyperparams import check, whole_problem

NonEmpty = Annotated[str, StringConstraints(min_length=1)]

DIFFICULTIES = range(1, 6)
"""A scenario's difficulty: 1 (one tool call) to 5 (a long multi-step task), ART's scale."""


class MCPTool(BaseModel):
    """One tool of an MCP server, as the policy is offered it.

    Attributes:
        name: the tool's name, what a tool call names.
        description: what it does ("" when the server gives none).
        parameters: the JSON schema of its arguments (MCP's `inputSchema`).
    """

    model_config = ConfigDict(extra="forbid")

    name: NonEmpty
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        # a tool's arguments are a JSON object (MCP's inputSchema, OpenAI's function parameters);
        # a schema of another type could only ever be answered with "must be a JSON object"
        if "type" in value and value["type"] != "object":
            raise ValueError(
                f"the arguments schema has type {value['type']!r}; a tool's parameters must be an "
                "object schema ({'type': 'object', 'properties': {...}})"
            )
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        """A tool from {"name", "description", "parameters"} (ART's dict form).

        Raises:
            pydantic.ValidationError: no name, an unknown key, a value of the wrong type, or
                parameters whose schema type is not "object".
        """
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        """{"name", "description", "parameters"}: the `function` object of an OpenAI tool."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_tool_schema(self) -> dict[str, Any]:
        """The OpenAI chat tool: {"type": "function", "function": `to_dict()`}."""
        return {"type": "function", "function": self.to_dict()}


class MCPResource(BaseModel):
    """One resource of an MCP server (listed for scenario generation; not read by rollouts).

    Attributes:
        uri: its address on the server, e.g. "notes://countries".
        name, description: as the server lists them ("" when it gives no description).
        mime_type: its content type, None when the server does not say.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    uri: NonEmpty
    name: str
    description: str = ""
    mime_type: str | None = Field(default=None, alias="mimeType")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        """A resource from {"uri", "name", "description", "mimeType" or "mime_type"} (ART's form).

        Raises:
            pydantic.ValidationError: no uri, an unknown key or a value of the wrong type.
        """
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        """{"uri", "name", "description"} and "mimeType" when known (MCP's spelling)."""
        result: dict[str, Any] = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            result["mimeType"] = self.mime_type
        return result


class GeneratedScenario(BaseModel):
    """One training task for an agent on an MCP server.

    Attributes:
        task: what the user asks the agent to do.
        difficulty: 1 (one tool call) to 5 (a long multi-step task); an int, not a bool.

    Raises:
        pydantic.ValidationError: an empty task, or a difficulty that is not a whole number 1-5.
    """

    model_config = ConfigDict(extra="forbid")

    task: NonEmpty
    difficulty: Annotated[int, Field(strict=True, ge=1, le=5)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        """A scenario from {"task", "difficulty"}."""
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        """The task, cut at `max_length` characters with "…" when longer.

        Raises:
            HyperParameterError: `max_length` is not a whole number >= 1.
        """
        check("GeneratedScenario.preview", "max_length", max_length, whole_problem(1), "120")
        if len(self.task) <= max_length:
            return self.task
        return self.task[:max_length].strip() + "…"


class GeneratedScenarioCollection:
    """An ordered list of `GeneratedScenario`s with ART's helpers (split, filter, shuffle, preview).

    Iterable and indexable like a list; `len()` is the number of scenarios.
    """

    def __init__(self, scenarios: list[GeneratedScenario]) -> None:
        self.scenarios = list(scenarios)

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        """Raises pydantic.ValidationError for a scenario that is not {"task", "difficulty"}."""
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, json_str: str) -> GeneratedScenarioCollection:
        """A collection from `to_json()`'s text ({"scenarios": [...]}) or a bare JSON list.

        Raises:
            UserError: the text is not JSON, or neither of those two shapes.
            pydantic.ValidationError: a scenario that is not {"task", "difficulty"}.
        """
        try:
            data = json.loads(json_str)
        except ValueError as exc:
            raise UserError(f"GeneratedScenarioCollection.from_json: the text is not JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("scenarios"), list):
            data = data["scenarios"]
        if not isinstance(data, list):
            raise UserError(
                'GeneratedScenarioCollection.from_json: expected {"scenarios": [...]} or a JSON list '
                f"of scenarios, got a JSON {type(data).__name__}"
            )
        return cls.from_dicts(data)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [scenario.to_dict() for scenario in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        """{"scenarios": [{"task", "difficulty"}, ...]} as JSON text."""
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent)

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index: Any) -> Any:
        return self.scenarios[index]

    def shuffle(self, seed: int | None = None) -> GeneratedScenarioCollection:
        """A new collection in random order (`seed`: a repeatable order; None: ART's unseeded)."""
        shuffled = self.scenarios.copy()
        random.Random(seed).shuffle(shuffled)
        return GeneratedScenarioCollection(shuffled)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        """(the first `train_size` scenarios, the rest).

        Raises:
            HyperParameterError: `train_size` is not a whole number from 0 to `len(self)`.
        """
        check("GeneratedScenarioCollection.split", "train_size", train_size, whole_problem(0), "1")
        if train_size > len(self.scenarios):
            raise HyperParameterError(
                f"GeneratedScenarioCollection.split(train_size={train_size}) is more than the "
                f"{len(self.scenarios)} scenarios; pass at most train_size={len(self.scenarios)}",
                "train_size",
                train_size,
            )
        return (
            GeneratedScenarioCollection(self.scenarios[:train_size]),
            GeneratedScenarioCollection(self.scenarios[train_size:]),
        )

    def filter_by_difficulty(
        self, min_difficulty: int = 1, max_difficulty: int = 5
    ) -> GeneratedScenarioCollection:
        """The scenarios whose difficulty is within [min_difficulty, max_difficulty].

        Raises:
            HyperParameterError: a bound that is not a whole number 1-5, or min above max (the
                result would be empty whatever the scenarios).
        """
        where = "GeneratedScenarioCollection.filter_by_difficulty"
        for name, value in (("min_difficulty", min_difficulty), ("max_difficulty", max_difficulty)):
            check(where, name, value, whole_problem(1), "3")
            if value > DIFFICULTIES[-1]:
                raise HyperParameterError(
                    f"{where}({name}={value}) is above the highest difficulty {DIFFICULTIES[-1]}; "
                    f"pass {name} from 1 to {DIFFICULTIES[-1]}",
                    name,
                    value,
                )
        if min_difficulty > max_difficulty:
            raise HyperParameterError(
                f"{where}(min_difficulty={min_difficulty}) is above max_difficulty={max_difficulty}; "
                "pass min_difficulty <= max_difficulty",
                "min_difficulty",
                min_difficulty,
            )
        return GeneratedScenarioCollection(
            [s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty]
        )

    def get_difficulty_distribution(self) -> Counter:
        """difficulty -> number of scenarios."""
        return Counter(scenario.difficulty for scenario in self.scenarios)

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        """Print the first `n` tasks (cut at `max_task_length` characters) with their difficulty.

        Raises:
            HyperParameterError: `n` is not a whole number >= 0 (a negative one would slice from
                the end), or `max_task_length` not one >= 1.
        """
        check("GeneratedScenarioCollection.preview", "n", n, whole_problem(0), "5")
        check("GeneratedScenarioCollection.preview", "max_task_length", max_task_length, whole_problem(1), "120")
        for i, scenario in enumerate(self.scenarios[:n]):
            print(f"   {i + 1}. {scenario.preview(max_task_length)}  (difficulty {scenario.difficulty}/5)")

    def print_difficulty_distribution(self) -> None:
        """Print how many scenarios have each difficulty, as a bar per level."""
        counts = self.get_difficulty_distribution()
        print("Difficulty distribution:")
        for level in DIFFICULTIES:
            count = counts.get(level, 0)
            print(f"   {level}/5: {count:3d}  {'█' * min(count, 30)}")

    def get_summary(self) -> dict[str, Any]:
        """{"total_scenarios", "difficulty_distribution", "avg_difficulty", "avg_task_length"}
        (averages 0 for an empty collection; task length in characters)."""
        n = len(self.scenarios)
        return {
            "total_scenarios": n,
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n if n else 0,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n if n else 0,
        }
