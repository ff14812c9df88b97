"""What a group of vLLM inference replicas asks for: count, parallel sizes, GPUs and ports.

`compile_topology` places the replicas on hosts and GPUs and gives each its endpoint.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from art_mega.topology.base import (
    Flag,
    GpuId,
    Integer,
    ListenPort,
    SpecModel,
    check_identifier,
    unique_gpu_ids,
    unique_names,
)

RESERVED_NAMES = frozenset({"agent", "rollout", "trainer"})
"""Process-name prefixes art-mega uses itself; an inference spec may not take them."""


class InferenceSpec(SpecModel):
    """`replicas` vLLM servers, each with `tp * pp * dp` GPUs (or one CPU process on CPU hosts).

    `name` identifies the group (process names are `NAME-INDEX`). `host_ids` None means every
    host with GPUs (or every host when none has GPUs); replicas are spread over them in turn.
    `gpu_ids` restricts which GPUs of each of those hosts may be used; None takes free GPUs in
    index order. A replica stays on one host unless `tp * pp` exceeds one host's GPUs, in
    which case it spans whole hosts. The k-th replica on a host serves its OpenAI API on
    `api_port + k`; `api_port` None (the default) gives each replica a port its head host's
    agent finds free when the runtime starts (`ArtRuntime.start`: until then the replica's
    endpoint port is 0; `runtime.topology` holds the chosen ones), so two runs on one machine
    never meet on a fixed port. A port given is used as given, and a replica refuses to start
    when it is taken. `shared_gpus` lets replicas use the trainer's GPUs, sleeping while it
    trains. `python` is the interpreter that runs vLLM (None: the agent's own).
    Raises `ValidationError` for a bad or reserved name, sizes < 1, repeated ids or a port
    outside 1..65535.
    """

    name: str = "vllm"
    replicas: Integer = Field(default=1, ge=1)
    tp: Integer = Field(default=1, ge=1)
    pp: Integer = Field(default=1, ge=1)
    dp: Integer = Field(default=1, ge=1)
    host_ids: tuple[str, ...] | None = None
    gpu_ids: tuple[GpuId, ...] | None = None
    api_port: ListenPort | None = None
    shared_gpus: Flag = False
    python: str | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        check_identifier(value, "name")
        if value in RESERVED_NAMES:
            raise ValueError(
                f"name {value!r} is reserved for art-mega's own processes; pick another, e.g. 'vllm'"
            )
        return value

    @field_validator("host_ids")
    @classmethod
    def _check_host_ids(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("host_ids is empty; list at least one host or use None for all")
        return unique_names(value, "host_ids")

    @field_validator("gpu_ids")
    @classmethod
    def _check_gpu_ids(cls, value: tuple[int | str, ...] | None) -> tuple[int | str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("gpu_ids is empty; list at least one GPU or use None for any free")
        return unique_gpu_ids(value, "gpu_ids")

    @field_validator("python")
    @classmethod
    def _check_python(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(c in value for c in "\x00\r\n")):
            raise ValueError(f"python {value!r} must be an interpreter path or command name")
        return value

    @property
    def gpus_per_replica(self) -> int:
        """tp * pp * dp: the GPUs one replica uses on GPU hosts."""
        return self.tp * self.pp * self.dp
