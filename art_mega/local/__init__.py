"""ART's `art.local`: `LocalBackend` (module `art_mega.local.backend`, as ART's)."""

from art_mega.local.backend import LocalBackend

__all__ = ["LocalBackend"]
