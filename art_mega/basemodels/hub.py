"""Hugging Face Hub repo ids as `base_model` (`"Qwen/Qwen3-0.6B"`): a snapshot directory of the HF cache.

`huggingface_hub.snapshot_download` does the work and reads its environment as it always does:
HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1 (no
network: the cache alone answers), HF_TOKEN (private and gated repos), HF_ENDPOINT (a mirror).
With a network it downloads what is missing; offline it returns the cached snapshot of the
revision. Only what the trainer and vLLM read is fetched (`ALLOW_PATTERNS`): the top-level JSON
files (config, generation config, tokenizer config, weight index), safetensors weights and
tokenizer vocabularies; subfolders (onnx/, original/, gguf variants) and Mistral's duplicate
`consolidated*.safetensors` are not (`IGNORE_PATTERNS`).

A cached snapshot is a symlink farm: `models--Org--Name/snapshots/<commit>/<file>` links to
`../../blobs/<hash>`. The snapshot directory is the model directory every host reads (trainer
ranks, vLLM replicas, each agent's readability check), and every one of those readers follows
the links. A snapshot whose links point at missing blobs counts as lacking those files.
"""

from __future__ import annotations

import json
from pathlib import Path

from art_mega.errors import BaseModelError

ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
"""What `snapshot_download` fetches (fnmatch, so `*` also crosses `/`: `IGNORE_PATTERNS` keeps the
top level only)."""

IGNORE_PATTERNS = ("*/*", "consolidated*")
"""Files in subfolders, and Mistral-format weights that duplicate the HF shards."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A snapshot needs one of these (or a `*.tiktoken` file) for vLLM and the trainer's tokenizer."""


def repo_id_problem(name: str) -> str | None:
    """Why `name` is not a Hugging Face repo id (`huggingface_hub`'s own check: "name" or
    "namespace/name", letters, digits, '-', '_', '.'), or None when it is one."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as exc:
        return str(exc)
    return None


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The HF cache snapshot directory of `repo_id` (a repo id: `repo_id_problem` is None) at
    `revision` (None: the repo's default branch, "main"), downloaded first where the network is
    allowed and the cache lacks files.

    Returns an absolute path `<HF_HUB_CACHE>/models--Org--Name/snapshots/<commit>` whose
    config.json, safetensors weights (one `model.safetensors`, or `model.safetensors.index.json`
    and every shard it names) and a tokenizer file are readable through their links.

    Raises:
        BaseModelError (a UserError: exit code 2 on the CLI), one sentence naming the model, what
            is missing and the fix: offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) and the
            revision is not cached (or its ref names a snapshot that is not there); the Hub has
            no such repo, the repo is gated or private without a token that may read it, or it
            has no such revision; the Hub cannot be reached and nothing is cached; the cache
            cannot be written; the snapshot lacks config.json, the weights or a tokenizer.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    shown = f"base_model {repo_id!r}" + ("" if revision is None else f" (revision {revision!r})")
    cache = constants.HF_HUB_CACHE
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            problem = (
                f"{shown} has no snapshot in the Hugging Face cache {cache} and downloads are off "
                "(HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE); download it once with a network and the same "
                f"HF_HOME (hf download {repo_id}), or unset HF_HUB_OFFLINE and TRANSFORMERS_OFFLINE"
            )
        else:
            reason = str(exc.__cause__ or exc).splitlines()[0]
            problem = (
                f"{shown} could not be fetched from the Hugging Face Hub {constants.ENDPOINT} ({reason}) and "
                f"the cache {cache} lacks it; check this machine's network access to "
                f"{constants.ENDPOINT} (or HF_ENDPOINT) and try again"
            )
        raise BaseModelError(problem, repo_id, revision) from None
    except GatedRepoError:
        raise BaseModelError(
            f"{shown} is a gated repository on the Hugging Face Hub; accept its terms at "
            f"{constants.ENDPOINT}/{repo_id} and set HF_TOKEN to a token of that account",
            repo_id,
            revision,
        ) from None
    except RepositoryNotFoundError:
        raise BaseModelError(
            f"{shown} is no model repository on the Hugging Face Hub {constants.ENDPOINT} that this "
            "machine may read; check the name, or set HF_TOKEN to a token that may read the private repo",
            repo_id,
            revision,
        ) from None
    except RevisionNotFoundError:
        raise BaseModelError(
            f"{shown}: the repository has no revision {revision or constants.DEFAULT_REVISION!r} on the "
            "Hugging Face Hub; name an existing branch, tag or commit",
            repo_id,
            revision,
        ) from None
    except HfHubHTTPError as exc:
        reason = str(exc).splitlines()[0]
        raise BaseModelError(
            f"{shown} could not be downloaded from the Hugging Face Hub {constants.ENDPOINT} ({reason}); "
            f"try again later (the files already fetched stay in the cache {cache})",
            repo_id,
            revision,
        ) from None
    except OSError as exc:
        raise BaseModelError(
            f"{shown} could not be written to the Hugging Face cache {cache} ({exc}); free space there or "
            "point HF_HOME (or HF_HUB_CACHE) to a writable directory",
            repo_id,
            revision,
        ) from None
    snapshot = Path(folder).absolute()
    lacking = snapshot_lacks(snapshot)
    if lacking:
        raise BaseModelError(
            f"the Hugging Face cache snapshot {snapshot} of {shown} lacks {' and '.join(lacking)}, which "
            f"art-mega trains and serves from; download it again (hf download {repo_id}"
            + ("" if revision is None else f" --revision {revision}")
            + "), or use a model published with safetensors weights",
            repo_id,
            revision,
        )
    return snapshot


def snapshot_lacks(snapshot: Path) -> list[str]:
    """What of config.json, the safetensors weights and a tokenizer file `snapshot` lacks (each
    read through its link: a link to a missing blob is missing), as phrases; [] when complete."""
    from art_mega.trainer.hf_checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE

    lacking = [] if (snapshot / CONFIG_FILE).is_file() else [CONFIG_FILE]
    index = snapshot / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            shards = None
        if shards is None or not all(isinstance(s, str) for s in shards):
            lacking.append(f"a readable weight_map in {INDEX_FILE}")
        else:
            gone = [s for s in shards if not (snapshot / s).is_file()]
            if gone:
                lacking.append(f"the shards {', '.join(gone)} that {INDEX_FILE} names")
    elif not (snapshot / SINGLE_FILE).is_file():
        lacking.append(f"safetensors weights ({SINGLE_FILE} or {INDEX_FILE} and its shards)")
    if not any((snapshot / name).is_file() for name in TOKENIZER_FILES) and not any(
        p.is_file() for p in snapshot.glob("*.tiktoken")
    ):
        lacking.append(f"a tokenizer ({', '.join(TOKENIZER_FILES)} or a *.tiktoken file)")
    return lacking
