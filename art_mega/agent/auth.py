"""HMAC-SHA256 request signing for the agent control plane, bound to one agent.

Every request carries a timestamp, a random nonce, the sha256 of its body and the identity of
the agent it is meant for: the address that agent binds (`tcp://HOST:PORT`) and its incarnation
(128 random bits the agent draws when it starts). The signature covers method, path, timestamp,
nonce, body hash, address and incarnation, keyed by the per-launch secret, so a request is valid
for exactly one agent process, once: a sibling agent of the same launch, or the same agent
restarted with the same secret, refuses it. Everything is checked on the headers alone, before
a byte of the body is read; the body is then held to its signed hash.

The one exception is `GET /v1/identity`, signed for no agent (empty address and incarnation): it
executes nothing and answers the agent's identity, with a reply signature over the request's
nonce, so that a client learns whom to sign for (see `AgentClient`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

SECRET_ENV = "ART_MEGA_SECRET"
TIMESTAMP_HEADER = "x-art-timestamp"
NONCE_HEADER = "x-art-nonce"
SIGNATURE_HEADER = "x-art-signature"
BODY_HASH_HEADER = "x-art-body-sha256"
AGENT_HEADER = "x-art-agent"
INCARNATION_HEADER = "x-art-incarnation"
REPLY_SIGNATURE_HEADER = "x-art-reply-signature"
MAX_SKEW_S = 30.0
"""Requests whose timestamp differs from the receiver's clock by more than this are refused."""

MIN_SECRET_BYTES = 16

_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in (32, 64)}
"""`sign`'s header shapes: nonce and incarnation 32 lowercase hex digits, body hash and
signature 64; anything else is refused before the HMAC, so a remembered nonce is 32 bytes."""


class AuthError(Exception):
    """A request whose signature, timestamp, nonce, target or body is not acceptable (HTTP 401)."""


class AgentIdentity(BaseModel):
    """Which agent process a request is for: the address it binds and its incarnation.

    Also the body of `GET /v1/identity`. `UNBOUND` (both empty) signs the identity request only.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str
    incarnation: str


UNBOUND = AgentIdentity(address="", incarnation="")


def new_incarnation() -> str:
    """A fresh agent incarnation: 16 random bytes as 32 hex characters."""
    return secrets.token_hex(16)


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


def _message(
    method: str, path: str, timestamp: str, nonce: str, body_hash: str, target: AgentIdentity
) -> bytes:
    fields = (method.upper(), path, timestamp, nonce, body_hash, target.address, target.incarnation)
    return "\n".join(fields).encode()


def sign(
    secret: bytes,
    method: str,
    path: str,
    body: bytes,
    target: AgentIdentity,
    now: float | None = None,
) -> dict[str, str]:
    """Return the headers that authenticate one request to the agent `target`.

    Args:
        secret: the launch secret.
        method: HTTP method, e.g. "POST".
        path: the URL path, without scheme, host or query (e.g. "/v1/health").
        body: the exact request body bytes (b"" for none).
        target: the agent's identity (`UNBOUND` only for `GET /v1/identity`).
        now: the signing time in seconds since the epoch (default: the clock).
    """
    timestamp = f"{time.time() if now is None else now:.6f}"
    nonce = secrets.token_hex(16)
    body_hash = hashlib.sha256(body).hexdigest()
    message = _message(method, path, timestamp, nonce, body_hash, target)
    return {
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        BODY_HASH_HEADER: body_hash,
        AGENT_HEADER: target.address,
        INCARNATION_HEADER: target.incarnation,
        SIGNATURE_HEADER: hmac.new(secret, message, hashlib.sha256).hexdigest(),
    }


def _reply_mac(secret: bytes, nonce: str, body: bytes) -> str:
    message = b"reply\n" + nonce.encode() + b"\n" + hashlib.sha256(body).hexdigest().encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def reply_is_signed(secret: bytes, request_nonce: str, body: bytes, signature: str | None) -> bool:
    """Whether `signature` (the reply's `REPLY_SIGNATURE_HEADER`) proves `body` answers the
    request signed with `request_nonce` and comes from a holder of `secret`."""
    return signature is not None and hmac.compare_digest(_reply_mac(secret, request_nonce, body), signature)


class Verifier:
    """One agent's check of signed requests; remembers nonces so that a replay is refused.

    `identity` is the agent's own: a request signed for another address or incarnation is
    refused. Nonces are remembered for twice `max_skew_s`; a timestamp outside +/- `max_skew_s`
    seconds of the local clock is refused, so a forgotten nonce can never be replayed.
    Thread-safe.
    """

    def __init__(self, secret: bytes, identity: AgentIdentity, max_skew_s: float = MAX_SKEW_S) -> None:
        self._secret = secret
        self.identity = identity
        self._max_skew_s = max_skew_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._last_sweep = time.monotonic()

    def verify_headers(
        self, method: str, path: str, headers: Mapping[str, str], unbound: bool = False
    ) -> str:
        """Accept the request on its headers alone and consume its nonce; return the signed
        body sha256 (hex) that the body must then match (`check_body`).

        `unbound=True` (only for the identity route) also accepts a request signed for no agent.

        Raises:
            AuthError: naming why (unsigned, malformed or stale timestamp, meant for another
                agent or incarnation, bad signature, replayed nonce).
        """
        timestamp = headers.get(TIMESTAMP_HEADER)
        nonce = headers.get(NONCE_HEADER)
        signature = headers.get(SIGNATURE_HEADER)
        body_hash = headers.get(BODY_HASH_HEADER)
        address = headers.get(AGENT_HEADER)
        incarnation = headers.get(INCARNATION_HEADER)
        if (
            not timestamp
            or not nonce
            or not signature
            or not body_hash
            or address is None
            or incarnation is None
        ):
            raise AuthError("unsigned request")
        for name, value, digits in (
            (NONCE_HEADER, nonce, 32),
            (BODY_HASH_HEADER, body_hash, 64),
            (SIGNATURE_HEADER, signature, 64),
        ):
            if not _HEX[digits].fullmatch(value):
                raise AuthError(f"malformed {name}: expected {digits} lowercase hex digits")
        try:
            sent_at = float(timestamp) if len(timestamp) <= 32 else math.nan
        except ValueError:
            sent_at = math.nan
        if not math.isfinite(sent_at):  # nan would pass any skew comparison
            raise AuthError("malformed timestamp: expected seconds since the epoch, e.g. 1767225600.000000")
        if abs(time.time() - sent_at) > self._max_skew_s:
            raise AuthError("stale timestamp")
        target = AgentIdentity(address=address, incarnation=incarnation)
        if not (unbound and target == UNBOUND):
            if address != self.identity.address:
                raise AuthError(f"signed for the agent at {address or 'no address'}, not this one")
            if incarnation != self.identity.incarnation:
                raise AuthError(
                    "signed for another incarnation of this agent (it restarted, or the request is replayed)"
                )
        expected = hmac.new(
            self._secret, _message(method, path, timestamp, nonce, body_hash, target), hashlib.sha256
        ).hexdigest()
        if not hmac.compare_digest(expected, signature):
            raise AuthError("bad signature")
        with self._lock:
            self._sweep()
            if nonce in self._seen:
                raise AuthError("replayed nonce")
            self._seen[nonce] = time.monotonic()
        return body_hash

    @staticmethod
    def check_body(body_hash: str, body: bytes) -> None:
        """Raise `AuthError` unless `body` is the one whose sha256 the headers signed."""
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), body_hash):
            raise AuthError("bad signature: the body is not the one signed")

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """`verify_headers`, then `check_body` on `body` (for callers that hold the whole body)."""
        self.check_body(self.verify_headers(method, path, headers), body)

    def sign_reply(self, request_nonce: str, body: bytes) -> str:
        """The `REPLY_SIGNATURE_HEADER` value for `body` answering the request `request_nonce`."""
        return _reply_mac(self._secret, request_nonce, body)

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
