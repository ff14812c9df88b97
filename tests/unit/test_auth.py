import time

import pytest

from art_mega.runtime.auth import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AuthError,
    Verifier,
    load_secret,
    new_secret,
    sign,
)

SECRET = b"0123456789abcdef0123456789abcdef"


def test_signed_request_is_accepted_once():
    verifier = Verifier(SECRET)
    headers = sign(SECRET, "POST", "/v1/x", b'{"a":1}')
    verifier.verify("POST", "/v1/x", headers, b'{"a":1}')
    with pytest.raises(AuthError, match="replayed"):
        verifier.verify("POST", "/v1/x", headers, b'{"a":1}')


@pytest.mark.parametrize(
    "method,path,body",
    [("GET", "/v1/x", b'{"a":1}'), ("POST", "/v1/y", b'{"a":1}'), ("POST", "/v1/x", b'{"a":2}')],
)
def test_tampered_method_path_or_body_is_refused(method, path, body):
    headers = sign(SECRET, "POST", "/v1/x", b'{"a":1}')
    with pytest.raises(AuthError, match="bad signature"):
        Verifier(SECRET).verify(method, path, headers, body)


def test_wrong_secret_is_refused():
    headers = sign(b"another-secret-of-enough-length", "GET", "/v1/health", b"")
    with pytest.raises(AuthError, match="bad signature"):
        Verifier(SECRET).verify("GET", "/v1/health", headers, b"")


def test_unsigned_and_partly_signed_are_refused():
    with pytest.raises(AuthError, match="unsigned"):
        Verifier(SECRET).verify("GET", "/v1/health", {}, b"")
    headers = sign(SECRET, "GET", "/v1/health", b"")
    del headers[NONCE_HEADER]
    with pytest.raises(AuthError, match="unsigned"):
        Verifier(SECRET).verify("GET", "/v1/health", headers, b"")


@pytest.mark.parametrize("offset", [-31.0, 31.0])
def test_stale_timestamps_are_refused(offset):
    headers = sign(SECRET, "GET", "/v1/health", b"", now=time.time() + offset)
    with pytest.raises(AuthError, match="stale"):
        Verifier(SECRET, max_skew_s=30).verify("GET", "/v1/health", headers, b"")


def test_timestamp_is_covered_by_the_signature():
    headers = sign(SECRET, "GET", "/v1/health", b"")
    headers[TIMESTAMP_HEADER] = f"{float(headers[TIMESTAMP_HEADER]) + 1:.6f}"
    with pytest.raises(AuthError, match="bad signature"):
        Verifier(SECRET).verify("GET", "/v1/health", headers, b"")


def test_signatures_differ_per_request():
    a = sign(SECRET, "GET", "/v1/health", b"")
    b = sign(SECRET, "GET", "/v1/health", b"")
    assert a[NONCE_HEADER] != b[NONCE_HEADER]
    assert a[SIGNATURE_HEADER] != b[SIGNATURE_HEADER]


def test_load_secret_rules():
    secret = new_secret()
    assert load_secret(" " + secret + "\n") == secret.encode()
    assert len(load_secret(new_secret())) == 64
    with pytest.raises(ValueError, match="not set"):
        load_secret(None)
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
