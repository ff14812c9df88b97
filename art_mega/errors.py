"""User-facing error type and the one-sentence formatting of validation errors.

Every mistake a user can make (bad topology, bad CLI value, missing file) surfaces as
`UserError`; the CLI prints its message as one sentence and exits with code 2.
"""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """A mistake in the user's input: printed as one sentence, exit code 2, no traceback.

    The message names the field, the value and the fix.
    """

    exit_code = 2


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


class PreflightError(UserError):
    """The cluster failed a check before any model was allocated; names the host and the cause."""


class HostMismatchError(PreflightError):
    """A host is not as the launch names it (a GPU named twice or absent, a socket interface it
    lacks or cannot parse), found by host admission before any rank starts.

    Attributes:
        host: the host id, e.g. "host1".
        field: what names the thing, e.g. "gpu_ids" or "GLOO_SOCKET_IFNAME".
        value: the value as given.
    """

    def __init__(self, message: str, host: str, field: str, value: object):
        super().__init__(message)
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
