"""Every user-facing art-mega exception, with fields, and the one exit-code table.

An exception is here when it reaches a user: the user's program (raised by `backend.train`,
`register`, a rollout, a gather, ...), the CLI, or the controller's failure report. Each one
carries the facts its one-sentence message is built from as typed attributes (host, address,
step, path, field, value, ...), so a program can act on them without parsing the text.

`EXIT_CODES` (at the end) gives every one of them, and the outside exceptions a report meets
(pydantic's `ValidationError`, `KeyboardInterrupt`), an `Exit`: the process exit code (2 a
mistake in the user's input, 1 a failure, 130 an interrupt) and whether the report shows the
traceback (a failure whose cause is in code, where the message alone does not help) or only the
one sentence. `exit_code_for(exc)` and `describe(exc)` read it; `launch.cli._guarded` and
`launch.controller.describe_failure` report through them, and nothing else maps an exception to
an exit code (a signal's 128+N is the controller's, for a signal, not an exception; click's own
refusal of an option in `launch.cli.main` keeps click's code, 2).

Exceptions that stay in their modules, because no user ever sees them:
- `agent.auth.AuthError`: a refused signature, answered as HTTP 401 inside the agent; the
  controller sees `AgentUnauthorizedError`.
- `agent.routes.RouteError`: a route's refusal, turned into its HTTP status by `SignedRouter`;
  the controller sees `AgentRefusedError` / `AgentFailedError`.
- `rollouts.routes._WorkerStartError`, `rollouts.worker._ValueRefused`: carry a worker's failure
  to the reply that reports it (`RemoteFailure`).
- `rollouts.wire.WireError`: a value that cannot travel; the controller raises
  `RolloutValueError` naming the rollout and host instead.
- `trainer.rank.jobs.StepOrderError`, `trainer.rank.main.InvalidMessageError`: a rank refusing a job
  (its step number, a malformed line on its socket) inside the rank process; the controller sees
  the rank's `failed` event, a `TrainerJobError`.
- `rewards.ruler._ReplyError`: a judge's reply that is not the scores asked for; RULER asks once
  more, then raises `RulerJudgeError`.
- `transfer.nixl.TransferError`, `transfer.routes.NixlWorkerError`: a NIXL step failing on the
  agent's side; the reply carries its text and the controller raises `AdapterTransferError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import ValidationError


class ArtMegaError(Exception):
    """Base of every art-mega exception here; catch it to catch them all.

    `exit_code` is its row of `EXIT_CODES` (see `exit_code_for`).
    """

    @property
    def exit_code(self) -> int:
        """The process exit code a report of this exception ends with."""
        return exit_code_for(self)


class UserError(ArtMegaError):
    """A mistake in the user's input: printed as one sentence, exit code 2, no traceback.

    The message names the field, the value and the fix.
    """


class TokenizationError(UserError):
    """A conversation training cannot tokenize exactly: a sampled Choice without token ids or
    logprobs, a tool call whose arguments are not a JSON object, or a chat template that fails
    on the conversation or renders an assistant turn so that its tokens cannot be that turn's.

    Attributes:
        where: the conversation, e.g. "trajectory 3 of group 0".
        message_index: the index in its `messages_and_choices` of the message at fault (None
            where the history itself is malformed).
    """

    def __init__(self, message: str, where: str, message_index: int | None):
        super().__init__(message)
        self.where = where
        self.message_index = message_index


class SFTFileError(UserError):
    """An SFT JSONL file that cannot be trained, found when it is read (before any SFT step).

    Attributes:
        path: the file.
        line: the 1-based line at fault (None where it is about the whole file).
    """

    def __init__(self, message: str, path: str, line: int | None = None):
        super().__init__(message)
        self.path = path
        self.line = line


class ModelSplitError(UserError):
    """The model's attention heads, KV heads, FFN width or experts do not divide by the trainer's
    tensor / expert parallel sizes (found from config.json at `register`, before any rank starts).

    Attributes:
        model_dir: the HF model directory.
        tp, ep, etp: the sizes asked for.
    """

    def __init__(self, message: str, model_dir: str, tp: int, ep: int = 1, etp: int = 1):
        super().__init__(message)
        self.model_dir = model_dir
        self.tp = tp
        self.ep = ep
        self.etp = etp


class MemoryPlanError(UserError):
    """A trainer rank or a vLLM replica would not fit its GPU's memory (the memory plan that
    `MegatronBackend.register` computes from config.json and the GPUs' NVML memory before any
    rank or replica starts, `trainer.prepare.memory_plan`).

    Attributes:
        model: the base model as the user named it.
        process: "trainer rank 0" or "replica vllm/0".
        host_id: the host it would run on.
        needed_bytes: the bytes the plan gives it.
        available_bytes: the bytes its GPU(s) offer it.
    """

    def __init__(
        self, message: str, model: str, process: str, host_id: str, needed_bytes: int, available_bytes: int
    ):
        super().__init__(message)
        self.model = model
        self.process = process
        self.host_id = host_id
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class AdapterMismatchError(UserError):
    """A LoRA adapter to start from (a warm-start `base_model`, or the run's committed checkpoint)
    does not have the backend's LoRA rank, alpha or target modules, or is not a plain LoRA.

    Attributes:
        adapter_dir: the adapter directory.
        mismatches: adapter_config.json key -> (the adapter's value, the backend's value).
    """

    def __init__(self, message: str, adapter_dir: str, mismatches: dict[str, tuple[Any, Any]]):
        super().__init__(message)
        self.adapter_dir = adapter_dir
        self.mismatches = mismatches


class RuntimeBusyError(UserError):
    """`register` found trainer ranks or replicas already running on the runtime's agents (another
    backend's, not closed): starting a second set would fail or stop them.

    Attributes:
        host: the first host with such processes; children: their child ids there.
    """

    def __init__(self, message: str, host: str, children: tuple[str, ...]):
        super().__init__(message)
        self.host = host
        self.children = children


class RemoteUserError(UserError):
    """A user mistake found on another host's rollout worker: its one sentence, and where.

    Attributes:
        host, worker_id: where it was found; exc_type: the remote exception's class name.
    """

    def __init__(self, message: str, host: str, worker_id: str = "", exc_type: str = ""):
        super().__init__(message)
        self.host = host
        self.worker_id = worker_id
        self.exc_type = exc_type


class RolloutValueError(UserError):
    """A rollout argument or result holds a value JSON cannot carry (bytes, a set, an arbitrary
    object, a numpy array, a complex number, ...), or a result that cannot be rebuilt where it
    arrives; see `rollouts.wire` for what travels and the conversions it makes.

    Attributes:
        rollout: the rollout's `module:qualname`.
        host: the host the value came from or was going to.
        detail: what is wrong, with the key path (e.g. "returned a value that cannot travel:
            trajectory.metadata['scores'][2] is a set, ...").
    """

    def __init__(self, message: str, rollout: str, host: str, detail: str):
        super().__init__(message)
        self.rollout = rollout
        self.host = host
        self.detail = detail


def _format_loc(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, str) and "[" in item:
            # A union member's tag such as "function-after[...]" or "tuple[str, ...]".
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def format_validation_error(exc: Exception, model: str | None = None) -> str:
    """Turn a pydantic `ValidationError` into one sentence naming the field and the value.

    Only the first error is reported: one sentence, one fix, on one line (line breaks in a
    message are folded into spaces). Missing fields say "is required", unknown fields say
    "is not a known field"; the value itself is shown only where it helps. Non-pydantic errors
    are returned as `str(exc)`.
    """
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    items = errors(include_url=False)
    if not items:
        return str(exc)
    first = items[0]
    loc = _format_loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    name = model or getattr(exc, "title", None) or "input"
    where = f"{name}.{loc}" if loc else name
    kind = first.get("type")
    shown = repr(first.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    if kind in {"value_error", "assertion_error"}:
        sentence = f"{where}: {msg}"
    elif kind == "missing":
        sentence = f"{where} is required; set it"
    elif kind == "extra_forbidden":
        sentence = f"{where}={shown} is not a known field; remove it or correct its name"
    else:
        sentence = f"{where}={shown} is invalid: {msg}"
    sentence = " ".join(sentence.split())
    return sentence if sentence.endswith(".") else sentence + "."


class TrainInputError(UserError):
    """An argument of `backend.train` / `train_sft` is not what training takes (a list where a
    `TrajectoryGroup` belongs, an empty group, an unknown role, a message `content` that is not a
    string, a list of parts or None).

    Attributes:
        argument: the argument's name, e.g. "trajectory_groups".
        group, trajectory: where the bad value sits (None where it is the argument itself).
    """

    def __init__(self, message: str, argument: str, group: int | None = None, trajectory: int | None = None):
        super().__init__(message)
        self.argument = argument
        self.group = group
        self.trajectory = trajectory


class NonFiniteValueError(UserError):
    """A NaN or +-inf reward, advantage or sampling logprob reached the edge of training.

    Attributes:
        quantity: what it is ("reward", "advantage", "logprob").
        value: the offending value.
        group, trajectory: where it sits (None when not known to the raiser).
    """

    def __init__(
        self,
        message: str,
        quantity: str,
        value: float,
        group: int | None = None,
        trajectory: int | None = None,
    ):
        super().__init__(message)
        self.quantity = quantity
        self.value = value
        self.group = group
        self.trajectory = trajectory


class HyperParameterError(UserError):
    """A hyper-parameter of `backend.train`, `train_sft` or a dataset iterator is out of range or of
    the wrong type (never replaced by a default).

    Attributes:
        name: the parameter, e.g. "learning_rate".
        value: what was given.
    """

    def __init__(self, message: str, name: str, value: object):
        super().__init__(message)
        self.name = name
        self.value = value


class NonFiniteStepError(UserError):
    """A trainer rank found a non-finite loss or gradient norm and aborted the step before the
    optimizer update: nothing changed on the rank and nothing was committed.

    Attributes:
        quantity: the first non-finite quantity, e.g. "loss/policy" or "loss/grad_norm".
        value: its value (nan, inf or -inf).
        step: the training step (None where the raiser does not know it).
    """

    def __init__(self, quantity: str, value: float, step: int | None = None):
        at = "a training step" if step is None else f"training step {step}"
        super().__init__(
            f"{at} was aborted before the optimizer update because {quantity} is {value}; nothing "
            "was committed and the served step did not move; look for extreme rewards or "
            "advantages, or lower learning_rate"
        )
        self.quantity = quantity
        self.value = value
        self.step = step

    def at_step(self, step: int) -> NonFiniteStepError:
        """The same error naming `step`."""
        return NonFiniteStepError(self.quantity, self.value, step)


class NonFiniteCheckpointError(UserError):
    """A checkpoint was refused before it was committed because a LoRA or optimizer tensor of
    some rank holds NaN or +-inf (the step's update made the weights non-finite).

    Attributes:
        tensor: the first non-finite tensor, e.g. "rank 0 lora decoder.layers.0...lora_B".
        step: the step whose checkpoint was refused.
    """

    def __init__(self, tensor: str, step: int):
        super().__init__(
            f"the checkpoint of step {step} was not committed because {tensor} holds NaN or inf "
            "values after the optimizer update; the trainer restarts from the last commit on the "
            "next backend.train; lower learning_rate or look for extreme rewards"
        )
        self.tensor = tensor
        self.step = step


class CheckpointFileError(UserError):
    """A file of a run's checkpoints (the commit pointer, a manifest) is malformed, so
    the run cannot tell which step to resume from (`art_mega.trainer.checkpoint`).

    Attributes:
        path: the file.
        problem: what is wrong with it, e.g. "holds 'x', not the number of the last committed step".
    """

    def __init__(self, path: Any, problem: str):
        super().__init__(
            f"{path} {problem}; restore it from a copy, or give the model another name to start a new run"
        )
        self.path = str(path)
        self.problem = problem


class BaseModelError(UserError):
    """`TrainableModel.base_model` resolves to no model art-mega can train and serve, found at
    `register` before any rank or replica starts (`art_mega.basemodels.resolve`, `.hub`).

    Attributes:
        base_model: the name or path as given, e.g. "Qwen/Qwen3-0.6B".
        revision: the Hugging Face revision asked for (None: the repo's default branch).
    """

    def __init__(self, message: str, base_model: str, revision: str | None = None):
        super().__init__(message)
        self.base_model = base_model
        self.revision = revision


class PeakFlopsError(UserError):
    """A device or dtype whose dense peak FLOP/s art-mega does not know, asked for an MFU figure
    (`trainer.flops.peak_flops_for`): refused rather than guessed.

    Attributes:
        device_name: the device as torch.cuda.get_device_name() spells it, e.g. "NVIDIA H100 PCIe".
        dtype: the dtype asked for, e.g. "bfloat16".
    """

    def __init__(self, message: str, device_name: str, dtype: str):
        super().__init__(message)
        self.device_name = device_name
        self.dtype = dtype


class PreflightError(UserError):
    """The cluster failed a check before any model was allocated; names the host and the cause.

    Attributes:
        hosts: the host ids the check found at fault, e.g. ("host1",), or both hosts of a pair
            that disagree ("host0", "host1").
    """

    def __init__(self, message: str, hosts: Sequence[str]):
        super().__init__(message)
        self.hosts = tuple(hosts)


class HostMismatchError(PreflightError):
    """A host is not as the launch names it (a GPU named twice or absent, a socket interface it
    lacks or cannot parse), found by host admission before any rank starts.

    Attributes:
        host: the host id, e.g. "host1".
        field: what names the thing, e.g. "gpu_ids" or "GLOO_SOCKET_IFNAME".
        value: the value as given.
    """

    def __init__(self, message: str, host: str, field: str, value: object):
        super().__init__(message, (host,))
        self.host = host
        self.field = field
        self.value = value


class LoopbackAddressError(UserError):
    """A multi-host launch would advertise a loopback address for one host's agent (a literal
    127.x/::1, or a name such as Debian's own hostname that resolves to 127.0.1.1).

    Attributes:
        host: the host as the user named it (e.g. the `--host` value).
        address: the loopback address it stands for.
    """

    def __init__(self, message: str, host: str, address: str):
        super().__init__(message)
        self.host = host
        self.address = address


class ProgramImportError(UserError):
    """Importing the `--program` module failed (a missing package, or its top-level code raised).

    Attributes:
        module: the program's module name.
        cause: the exception's type name, e.g. "ModuleNotFoundError".
    """

    def __init__(self, message: str, module: str, cause: str):
        super().__init__(message)
        self.module = module
        self.cause = cause


class MissingExtraError(UserError):
    """A feature needs an optional dependency that is not installed.

    Attributes:
        feature: what needs it, e.g. "art_mega.mcp.list_tools".
        package: the missing import, e.g. "mcp".
        extra: the art-mega extra that installs it, e.g. "mcp".
    """

    def __init__(self, feature: str, package: str, extra: str):
        super().__init__(
            f"{feature} needs the {package!r} package, which is not installed; "
            f"pip install 'art-mega[{extra}]'"
        )
        self.feature = feature
        self.package = package
        self.extra = extra


class LangGraphUsageError(UserError):
    """`art_mega.langgraph` refused a call: an `init_chat_model` argument art-mega does not take
    or cannot honour, a chat model made outside a rollout wrapped by `wrap_rollout`, or a
    wrapped rollout that returned no `Trajectory` or streamed a completion (no token ids to
    train).

    Attributes:
        call: the refused call, e.g. "init_chat_model".
        field: the argument or input at fault, e.g. "model_provider".
        value: what was given.
    """

    def __init__(self, message: str, call: str, field: str, value: object):
        super().__init__(message)
        self.call = call
        self.field = field
        self.value = value


class AgentError(ArtMegaError):
    """An agent could not be reached, refused a call, or answered it badly (`agent.client`).

    Printed as "host HOST (ADDRESS): REASON"; not a mistake in the user's input (exit code 1).
    Raised as one of the subclasses below by `AgentClient.call`, and as this class itself where
    an agent answered but is not the one the launch expects (another launch id or pid).

    Attributes:
        host: the host id, e.g. "host1".
        address: the agent's address, tcp://HOST:PORT.
        reason: the message without its "host HOST (ADDRESS): " prefix.
        status: the HTTP status the agent answered (None: no answer, or a 200 that was refused).
        detail: the agent's own `{"detail": ...}` for a non-200 answer, "" otherwise.
        route: the call, e.g. "POST /v1/etcd/start" ("" where no single call failed).
        timed_out: True when no answer came within the call's timeout (the agent may be alive but
            slow, or the network partitioned), False when it was refused, reset or answered.
    """

    def __init__(
        self,
        host: str,
        address: str,
        reason: str,
        *,
        status: int | None = None,
        detail: str = "",
        route: str = "",
        timed_out: bool = False,
    ) -> None:
        super().__init__(f"host {host} ({address}): {reason}")
        self.host = host
        self.address = address
        self.reason = reason
        self.status = status
        self.detail = detail
        self.route = route
        self.timed_out = timed_out


class AgentUnreachableError(AgentError):
    """The agent did not answer: the connection was refused or reset, or (`timed_out`) no answer
    came within the call's timeout. `status` is None."""


class AgentUnauthorizedError(AgentError):
    """The agent answered 401: it refused the request's signature (another launch's secret, a
    restarted agent, which is another incarnation, or a stale or replayed request); `detail`
    says which."""


class AgentRefusedError(AgentError):
    """The agent answered another 4xx: it refused the call's input (413 for a body over the
    route's cap, 422 for a body that is not the route's model, 404 for an unknown worker);
    `detail` is the agent's reason."""


class AgentFailedError(AgentError):
    """The agent answered 5xx (or another status than 200 and 4xx): the route's handler failed
    there; `detail` is the agent's text."""


class AgentReplyError(AgentError):
    """The agent answered 200, but not with what the call expects: a body that is not the route's
    response model (`route` names the call), or an identity answer not signed with the launch's
    secret (something else listens at the address). `status` is 200."""


class RemoteRolloutError(ArtMegaError):
    """A rollout raised on its worker (its own code failed there; not a user mistake).

    Attributes:
        host, worker_id: where it ran.
        exc_type: the remote exception's class name, e.g. "ValueError".
        traceback: the remote traceback, as text.
        failure: the worker's whole report (`rollouts.protocol.RemoteFailure`: kind, message,
            exc_type, traceback).
    """

    def __init__(self, host: str, worker_id: str, failure: Any) -> None:
        super().__init__(f"rollout on host {host} worker {worker_id} failed: {failure.message}")
        self.host = host
        self.worker_id = worker_id
        self.exc_type: str = failure.exc_type
        self.traceback: str = failure.traceback
        self.failure = failure


class TopologyError(UserError):
    """A topology that is valid field by field but cannot be placed as a whole.

    Raised by `compile_topology` (unknown host ids, GPU overlap, port collisions, sizes that do
    not divide the world, missing multi-host transport) and by lookups such as
    `ClusterSpec.host` for an unknown host id. Exit code 2; the message names the spec's field,
    the value and the fix.

    Attributes:
        field: the spec field at fault as the message names it, e.g. "TrainerSpec.host_ids",
            "InferenceSpec(name='vllm').gpu_ids" or "ClusterSpec.nccl_transport".
    """

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class MCPServerError(ArtMegaError):
    """An MCP server could not be started, reached or asked (`art_mega.mcp`).

    Attributes:
        server: the server as `McpServer.describe()` names it (its command line or URL).
        action: what was being done, e.g. "listing its tools".
        detail: the reason, e.g. "ConnectError: connection refused".
    """

    def __init__(self, server: str, action: str, detail: str):
        super().__init__(f"MCP server {server}: {action} failed: {detail}")
        self.server = server
        self.action = action
        self.detail = detail


class ScenarioGenerationError(ArtMegaError):
    """The scenario generator's reply could not be used (`art_mega.mcp.generate_scenarios`).

    Attributes:
        model: the generator model's name.
        detail: what was wrong with the reply (not JSON, a wrong count, a bad difficulty, ...).
    """

    def __init__(self, model: str, detail: str):
        super().__init__(f"scenario generator {model}: {detail}")
        self.model = model
        self.detail = detail


class RulerJudgeError(ArtMegaError):
    """RULER's judge did not give a usable answer (`art_mega.rewards.ruler`): it could not be
    reached or refused the request, or its reply did not parse as the scores asked for even
    after the one retry.

    Attributes:
        judge: the judge as RULER names it (the LiteLLM model name, or the Model judge's
            served name and model).
        detail: what went wrong, e.g. "APIConnectionError: Connection refused".
        attempts: the requests made (1, or 2 when an unparsable reply was asked again).
    """

    def __init__(self, judge: str, detail: str, attempts: int):
        super().__init__(f"RULER judge {judge}: {detail}")
        self.judge = judge
        self.detail = detail
        self.attempts = attempts


class HostLostError(ArtMegaError):
    """An agent stopped answering or was replaced while the program ran (`runtime.monitor`).

    Attributes:
        host: the host id, e.g. "host1".
        address: its agent's address, tcp://HOST:PORT.
        reason: why it counts as lost, e.g. "no heartbeat answer for 4.1 s".
    """

    def __init__(self, host: str, address: str, reason: str) -> None:
        super().__init__(f"host {host} ({address}) was lost: {reason}")
        self.host = host
        self.address = address
        self.reason = reason


class AgentStartError(ArtMegaError):
    """An agent this machine started did not become ready (`runtime.local_agent`): it exited, was
    not ready in time, or is not the process that was started.

    Attributes:
        host: the host id; address: the address it was to listen on, tcp://HOST:PORT.
        reason: what went wrong, e.g. "agent not ready after 120 s".
    """

    def __init__(self, host: str, address: str, reason: str) -> None:
        super().__init__(f"host {host} ({address}): {reason}")
        self.host = host
        self.address = address
        self.reason = reason


class TrainerJobError(ArtMegaError, RuntimeError):
    """A trainer rank failed or died (`trainer.remote`); names the rank, host and log file.

    Attributes:
        rank: the first failing rank (None where no one rank is at fault).
        host: its host id; log_path: its log file.
        clean: True only when every rank refused the job before changing its state (its `failed`
            event says `dirty: false`, e.g. a wrong step number); the ranks then need no recovery.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        host: str | None = None,
        log_path: str | None = None,
        clean: bool = False,
    ):
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.log_path = log_path
        self.clean = clean


class RankRefusedStepError(TrainerJobError, UserError):
    """The ranks refused a step over its numbers: a non-finite loss or gradient norm (aborted
    before the optimizer update; the ranks stay clean) or a non-finite LoRA/optimizer tensor
    before the checkpoint commit (the ranks are then restarted from the commit). A user error
    (exit code 2) whose message is the rank's sentence, naming the step and the quantity.

    Attributes:
        error_type: the rank's exception, one of `trainer.remote.REFUSALS`.
    """

    def __init__(
        self, message: str, error_type: str, rank: int, host: str | None, log_path: str | None, clean: bool
    ):
        super().__init__(message, rank, host, log_path, clean)
        self.error_type = error_type


class ReplicaHTTPError(ArtMegaError):
    """A vLLM server refused a call or could not be reached (`inference.server_api`).

    Attributes:
        replica: the replica's process name, e.g. "vllm-0"; url: its server, http://HOST:PORT.
        what: the call, e.g. "loading adapter step 3".
        status: the HTTP status code (None when no answer came).
        answer: the server's body (or the transport error) as text.
    """

    def __init__(self, replica: str, url: str, what: str, status: int | None, answer: str) -> None:
        code = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"replica {replica} ({url}): {what} failed with {code}: {answer}")
        self.replica = replica
        self.url = url
        self.what = what
        self.status = status
        self.answer = answer


class ReplicaRequestError(ArtMegaError):
    """A request of the program's to one replica failed (e.g. it died while answering;
    `inference.policy_client`); the cause is chained.

    Attributes:
        replica: the replica's process name; url: its server; model: the model asked for.
    """

    def __init__(self, replica: str, url: str, model: str, cause: BaseException) -> None:
        super().__init__(
            f"request to replica {replica} ({url}) for model {model} failed: {type(cause).__name__}: {cause}"
        )
        self.replica = replica
        self.url = url
        self.model = model


class CompletionReplyError(ArtMegaError):
    """An OpenAI-compatible server answered a completion request (HTTP 200) with a body art-mega
    cannot read as one: no choices, a choice without its message or text, a message whose
    content or tool calls are not of their types (`inference.replies`).

    Attributes:
        server: who answered, e.g. "replica vllm-0 (http://127.0.0.1:8400)" or
            "server http://127.0.0.1:9000/v1".
        model: the model the request asked for.
        detail: what came back and what was expected, e.g. "no choices (choices=[]) where a
            list of at least one choice was expected".
    """

    def __init__(self, server: str, model: str, detail: str) -> None:
        super().__init__(f"{server} answered a completion request for model {model} with {detail}")
        self.server = server
        self.model = model
        self.detail = detail


class UnsupportedNameError(UserError, ImportError):
    """An ART name art-mega does not provide, accessed as an attribute or imported
    (`from art_mega import ServerlessBackend`; the sentences: `art_mega.unsupported`). An
    ImportError, not an AttributeError: Python replaces an AttributeError of `from m import x`
    by its own "cannot import name" and the sentence would be lost."""


class LocalServingUnavailableError(ArtMegaError, RuntimeError):
    """ART 0.5.23's `art.LocalServingUnavailableError`: the managed local inference is
    unavailable (in art-mega: every replica is down, `NoReplicaUpError`), so a rollout cannot be
    served; `except art.LocalServingUnavailableError` catches it as in ART."""


class NoReplicaUpError(LocalServingUnavailableError):
    """Every replica is down (restarting after a crash; `inference.router`).

    Attributes:
        model: the replicas' served model name.
        reasons: each replica, its URL and why it is down, e.g. "vllm-0 (http://...): exited 1".
    """

    def __init__(self, model: str, reasons: str) -> None:
        super().__init__(f"no replica of {model} is up: {reasons}")
        self.model = model
        self.reasons = reasons


class ReplicaSleepError(ArtMegaError):
    """A shared-GPU replica did not sleep or wake (`inference.sleep`); names the replica and the
    server's answer.

    Attributes:
        failures: each replica's refusal (`ReplicaHTTPError`: name, URL, status, answer).
    """

    def __init__(self, message: str, failures: Sequence[ReplicaHTTPError] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


class ReplicaStartError(ArtMegaError):
    """A replica did not come up: it exited, or was not ready in time (`inference.replica`,
    `inference.remote`); names it and the tail of its log.

    Attributes:
        replica: the replica's process name, e.g. "vllm-0".
    """

    def __init__(self, message: str, replica: str) -> None:
        super().__init__(message)
        self.replica = replica


class AdapterPublishError(ArtMegaError):
    """Some replica did not load a step's adapter after the retry; the served step did not move
    (`inference.adapters`).

    Attributes:
        step: the step; model: the name it was to be served as.
        failures: each failing replica's name -> the server's last answer (`ReplicaHTTPError`,
            which carries the status code and body).
    """

    def __init__(self, step: int, model: str, failures: Mapping[str, ReplicaHTTPError]) -> None:
        parts = [f"{exc} (after 2 attempts)" for exc in failures.values()]
        super().__init__(
            f"publishing step {step} as {model} failed, the served step did not advance: " + "; ".join(parts)
        )
        self.step = step
        self.model = model
        self.failures = dict(failures)


class AdapterTransferError(ArtMegaError):
    """A step's adapter did not reach a replica host intact (`transfer.remote`); the detail
    names the host, the transfer and the file where one is at fault (e.g. a sha256 mismatch).

    Attributes:
        step: the step whose adapter was sent; detail: what failed, where.
    """

    def __init__(self, step: int, detail: str) -> None:
        super().__init__(f"step {step}: {detail}")
        self.step = step
        self.detail = detail


class ArtifactFileError(ArtMegaError, RuntimeError):
    """An agent could not write or remove an artifact file (`transfer.files`).

    Attributes:
        host: the agent's host id; path: the file, relative to the artifact root.
        detail: the agent's reason, which names the path.
    """

    def __init__(self, host: str, path: str, detail: str) -> None:
        super().__init__(f"host {host}: {detail}")
        self.host = host
        self.path = path
        self.detail = detail


class Exit(NamedTuple):
    """How a report of an exception ends: the process exit code, and whether it shows the
    traceback (True) or only the exception's one sentence (False)."""

    code: int
    traceback: bool


_SENTENCE_USER = Exit(2, traceback=False)
_SENTENCE_FAILURE = Exit(1, traceback=False)
_TRACEBACK_FAILURE = Exit(1, traceback=True)

EXIT_CODES: dict[type[BaseException], Exit] = {
    # Mistakes in the user's input: one sentence, exit 2.
    UserError: _SENTENCE_USER,
    ValidationError: _SENTENCE_USER,
    TokenizationError: _SENTENCE_USER,
    SFTFileError: _SENTENCE_USER,
    ModelSplitError: _SENTENCE_USER,
    MemoryPlanError: _SENTENCE_USER,
    AdapterMismatchError: _SENTENCE_USER,
    RuntimeBusyError: _SENTENCE_USER,
    RemoteUserError: _SENTENCE_USER,
    RolloutValueError: _SENTENCE_USER,
    TrainInputError: _SENTENCE_USER,
    NonFiniteValueError: _SENTENCE_USER,
    HyperParameterError: _SENTENCE_USER,
    NonFiniteStepError: _SENTENCE_USER,
    NonFiniteCheckpointError: _SENTENCE_USER,
    CheckpointFileError: _SENTENCE_USER,
    BaseModelError: _SENTENCE_USER,
    PeakFlopsError: _SENTENCE_USER,
    PreflightError: _SENTENCE_USER,
    HostMismatchError: _SENTENCE_USER,
    LoopbackAddressError: _SENTENCE_USER,
    ProgramImportError: _SENTENCE_USER,
    MissingExtraError: _SENTENCE_USER,
    LangGraphUsageError: _SENTENCE_USER,
    TopologyError: _SENTENCE_USER,
    RankRefusedStepError: _SENTENCE_USER,
    UnsupportedNameError: _SENTENCE_USER,
    # A host or its agent failing: the sentence names it, exit 1.
    AgentError: _SENTENCE_FAILURE,
    AgentUnreachableError: _SENTENCE_FAILURE,
    AgentUnauthorizedError: _SENTENCE_FAILURE,
    AgentRefusedError: _SENTENCE_FAILURE,
    AgentFailedError: _SENTENCE_FAILURE,
    AgentReplyError: _SENTENCE_FAILURE,
    HostLostError: _SENTENCE_FAILURE,
    AgentStartError: _SENTENCE_FAILURE,
    # An outside service a program talks to failing: the sentence names it, exit 1.
    MCPServerError: _SENTENCE_FAILURE,
    ScenarioGenerationError: _SENTENCE_FAILURE,
    RulerJudgeError: _SENTENCE_FAILURE,
    CompletionReplyError: _SENTENCE_FAILURE,
    # Failures whose cause is in code (the program's, a rollout's, a rank's, a replica's): the
    # traceback shows where the program met them, exit 1.
    ArtMegaError: _TRACEBACK_FAILURE,
    RemoteRolloutError: _TRACEBACK_FAILURE,
    TrainerJobError: _TRACEBACK_FAILURE,
    ReplicaHTTPError: _TRACEBACK_FAILURE,
    ReplicaRequestError: _TRACEBACK_FAILURE,
    LocalServingUnavailableError: _TRACEBACK_FAILURE,
    NoReplicaUpError: _TRACEBACK_FAILURE,
    ReplicaSleepError: _TRACEBACK_FAILURE,
    ReplicaStartError: _TRACEBACK_FAILURE,
    AdapterPublishError: _TRACEBACK_FAILURE,
    AdapterTransferError: _TRACEBACK_FAILURE,
    ArtifactFileError: _TRACEBACK_FAILURE,
    # The user pressed Ctrl-C inside the program: 128 + SIGINT, as the shell counts it.
    KeyboardInterrupt: Exit(130, traceback=False),
}
"""Exception class -> its `Exit`. A class not listed takes its nearest listed base's row (its
MRO order); an exception with none (a bug, or the program's own error) is `Exit(1, traceback=True)`."""


def exit_row(exc: BaseException) -> Exit:
    """`exc`'s row of `EXIT_CODES`: its class's, else its nearest listed base's, else (1, traceback)."""
    for cls in type(exc).__mro__:
        row = EXIT_CODES.get(cls)
        if row is not None:
            return row
    return _TRACEBACK_FAILURE


def exit_code_for(exc: BaseException) -> int:
    """The process exit code a report of `exc` ends with: 2 user error, 1 failure, 130 interrupt."""
    return exit_row(exc).code


def describe(exc: BaseException) -> str | None:
    """The one line that reports `exc`, or None where its row shows the traceback instead.

    A `ValidationError` becomes `format_validation_error`'s sentence; anything else its message
    (its class name where the message is empty, e.g. a bare `KeyboardInterrupt`).
    """
    if exit_row(exc).traceback:
        return None
    if isinstance(exc, ValidationError):
        return format_validation_error(exc)
    return str(exc) or type(exc).__name__
