"""ART's `art.local.LocalBackend`, for programs that port by changing the import: the embedded
single-host `MegatronBackend` (one agent on loopback, one trainer rank, one vLLM replica)."""

from art_mega.backend import MegatronBackend as LocalBackend

__all__ = ["LocalBackend"]
