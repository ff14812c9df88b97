"""HMAC-SHA256 request signing for the agent control plane.

Every request carries a timestamp, a random nonce and a signature over method, path,
timestamp, nonce and the body's sha256, keyed by the per-launch secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time

SECRET_ENV = "ART_MEGA_SECRET"
TIMESTAMP_HEADER = "x-art-timestamp"
NONCE_HEADER = "x-art-nonce"
SIGNATURE_HEADER = "x-art-signature"
MAX_SKEW_S = 30.0
"""Requests whose timestamp differs from the receiver's clock by more than this are refused."""

MIN_SECRET_BYTES = 16


class AuthError(Exception):
    """A request whose signature, timestamp or nonce is not acceptable (HTTP 401)."""


def new_secret() -> str:
    """Return a fresh per-launch secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def load_secret(value: str | None) -> bytes:
    """Validate a secret string (from the environment or stdin) and return its bytes.

    Raises:
        ValueError: when it is missing or shorter than 16 bytes.
    """
    if not value or not value.strip():
        raise ValueError(f"{SECRET_ENV} is not set; the launcher must deliver the launch secret")
    raw = value.strip().encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"{SECRET_ENV} must be at least {MIN_SECRET_BYTES} bytes long")
    return raw


def _message(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    body_hash = hashlib.sha256(body).hexdigest()
    return "\n".join((method.upper(), path, timestamp, nonce, body_hash)).encode()


def sign(secret: bytes, method: str, path: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """Return the headers that authenticate one request.

    Args:
        secret: the launch secret.
        method: HTTP method, e.g. "POST".
        path: the URL path, without scheme, host or query (e.g. "/v1/health").
        body: the exact request body bytes (b"" for none).
        now: the signing time in seconds since the epoch (default: the clock).
    """
    timestamp = f"{time.time() if now is None else now:.6f}"
    nonce = secrets.token_hex(16)
    digest = hmac.new(secret, _message(method, path, timestamp, nonce, body), hashlib.sha256)
    return {
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: digest.hexdigest(),
    }


class Verifier:
    """Checks signed requests and remembers nonces so that a replay is refused.

    Nonces are remembered for twice `max_skew_s`; a timestamp outside +/- `max_skew_s`
    seconds of the local clock is refused, so a forgotten nonce can never be replayed.
    Thread-safe.
    """

    def __init__(self, secret: bytes, max_skew_s: float = MAX_SKEW_S) -> None:
        self._secret = secret
        self._max_skew_s = max_skew_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()

    def verify(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        """Accept the request or raise `AuthError` saying why (missing, stale, replayed, bad)."""
        timestamp = headers.get(TIMESTAMP_HEADER)
        nonce = headers.get(NONCE_HEADER)
        signature = headers.get(SIGNATURE_HEADER)
        if not timestamp or not nonce or not signature:
            raise AuthError("unsigned request")
        try:
            sent_at = float(timestamp)
        except ValueError:
            raise AuthError("malformed timestamp") from None
        if abs(time.time() - sent_at) > self._max_skew_s:
            raise AuthError("stale timestamp")
        expected = hmac.new(
            self._secret, _message(method, path, timestamp, nonce, body), hashlib.sha256
        ).hexdigest()
        if not hmac.compare_digest(expected, signature):
            raise AuthError("bad signature")
        with self._lock:
            self._sweep()
            if nonce in self._seen:
                raise AuthError("replayed nonce")
            self._seen[nonce] = time.monotonic()

    def _sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < self._max_skew_s:
            return
        horizon = now - 2 * self._max_skew_s
        self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
        self._last_sweep = now


def secret_from_env() -> bytes:
    """Read and validate the launch secret from `ART_MEGA_SECRET` (see `load_secret`)."""
    return load_secret(os.environ.get(SECRET_ENV))
