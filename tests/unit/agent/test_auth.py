import hashlib
import time

import pytest

from art_mega.agent.auth import (
    AGENT_HEADER,
    BODY_HASH_HEADER,
    INCARNATION_HEADER,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    UNBOUND,
    AgentIdentity,
    AuthError,
    Verifier,
    load_secret,
    new_incarnation,
    new_secret,
    reply_is_signed,
    sign,
)

SECRET = b"0123456789abcdef0123456789abcdef"
AGENT_A = AgentIdentity(address="tcp://10.0.0.1:22222", incarnation=new_incarnation())
AGENT_B = AgentIdentity(address="tcp://10.0.0.2:22222", incarnation=new_incarnation())


def verifier(identity: AgentIdentity = AGENT_A, **kw) -> Verifier:
    return Verifier(SECRET, identity, **kw)


def test_signed_request_is_accepted_once():
    a = verifier()
    headers = sign(SECRET, "POST", "/v1/x", b'{"a":1}', AGENT_A)
    a.verify("POST", "/v1/x", headers, b'{"a":1}')
    with pytest.raises(AuthError, match="replayed"):
        a.verify("POST", "/v1/x", headers, b'{"a":1}')


@pytest.mark.parametrize(
    "method,path,body",
    [("GET", "/v1/x", b'{"a":1}'), ("POST", "/v1/y", b'{"a":1}'), ("POST", "/v1/x", b'{"a":2}')],
)
def test_tampered_method_path_or_body_is_refused(method, path, body):
    headers = sign(SECRET, "POST", "/v1/x", b'{"a":1}', AGENT_A)
    with pytest.raises(AuthError, match="bad signature"):
        verifier().verify(method, path, headers, body)


def test_headers_are_checked_without_the_body_and_the_body_against_its_signed_hash():
    a = verifier()
    body = b'{"count": 1}'
    headers = sign(SECRET, "POST", "/v1/x", body, AGENT_A)
    assert headers[BODY_HASH_HEADER] == hashlib.sha256(body).hexdigest()
    signed_hash = a.verify_headers("POST", "/v1/x", headers)
    assert signed_hash == hashlib.sha256(body).hexdigest()
    a.check_body(signed_hash, body)
    with pytest.raises(AuthError, match="the body is not the one signed"):
        a.check_body(signed_hash, b'{"count": 2}')
    with pytest.raises(AuthError, match="replayed"):  # the nonce was spent on the headers
        a.verify_headers("POST", "/v1/x", headers)
    forged = {**sign(SECRET, "POST", "/v1/x", body, AGENT_A), BODY_HASH_HEADER: "0" * 64}
    with pytest.raises(AuthError, match="bad signature"):  # the body hash is signed too
        a.verify_headers("POST", "/v1/x", forged)


def test_a_request_for_one_agent_is_refused_by_its_sibling_and_by_its_next_incarnation():
    headers = sign(SECRET, "POST", "/v1/shutdown", b"", AGENT_A)
    with pytest.raises(AuthError, match=r"signed for the agent at tcp://10\.0\.0\.1:22222, not this one"):
        verifier(AGENT_B).verify("POST", "/v1/shutdown", headers, b"")
    restarted = AgentIdentity(address=AGENT_A.address, incarnation=new_incarnation())
    with pytest.raises(AuthError, match="another incarnation of this agent"):
        verifier(restarted).verify("POST", "/v1/shutdown", headers, b"")
    verifier().verify("POST", "/v1/shutdown", headers, b"")  # the one agent it was meant for


def test_target_headers_are_covered_by_the_signature():
    headers = sign(SECRET, "POST", "/v1/shutdown", b"", AGENT_A)
    moved = {**headers, AGENT_HEADER: AGENT_B.address, INCARNATION_HEADER: AGENT_B.incarnation}
    with pytest.raises(AuthError, match="bad signature"):
        verifier(AGENT_B).verify("POST", "/v1/shutdown", moved, b"")


def test_an_unbound_request_is_accepted_only_where_the_route_allows_it():
    headers = sign(SECRET, "GET", "/v1/identity", b"", UNBOUND)
    with pytest.raises(AuthError, match="signed for the agent at no address"):
        verifier().verify_headers("GET", "/v1/identity", headers)
    verifier().verify_headers("GET", "/v1/identity", headers, unbound=True)
    bound = sign(SECRET, "GET", "/v1/identity", b"", AGENT_B)
    with pytest.raises(AuthError, match="not this one"):  # unbound allows no other agent's
        verifier().verify_headers("GET", "/v1/identity", bound, unbound=True)


def test_a_reply_signature_binds_the_request_nonce_and_the_reply_body():
    a = verifier()
    signature = a.sign_reply("nonce-1", b'{"x": 1}')
    assert reply_is_signed(SECRET, "nonce-1", b'{"x": 1}', signature)
    assert not reply_is_signed(SECRET, "nonce-2", b'{"x": 1}', signature)
    assert not reply_is_signed(SECRET, "nonce-1", b'{"x": 2}', signature)
    assert not reply_is_signed(b"y" * 32, "nonce-1", b'{"x": 1}', signature)
    assert not reply_is_signed(SECRET, "nonce-1", b'{"x": 1}', None)


def test_wrong_secret_is_refused():
    headers = sign(b"another-secret-of-enough-length", "GET", "/v1/health", b"", AGENT_A)
    with pytest.raises(AuthError, match="bad signature"):
        verifier().verify("GET", "/v1/health", headers, b"")


@pytest.mark.parametrize(
    "header",
    [NONCE_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER, BODY_HASH_HEADER, AGENT_HEADER, INCARNATION_HEADER],
)
def test_unsigned_and_partly_signed_are_refused(header):
    with pytest.raises(AuthError, match="unsigned"):
        verifier().verify("GET", "/v1/health", {}, b"")
    headers = sign(SECRET, "GET", "/v1/health", b"", AGENT_A)
    del headers[header]
    with pytest.raises(AuthError, match="unsigned"):
        verifier().verify("GET", "/v1/health", headers, b"")


@pytest.mark.parametrize("offset", [-31.0, 31.0])
def test_stale_timestamps_are_refused(offset):
    headers = sign(SECRET, "GET", "/v1/health", b"", AGENT_A, now=time.time() + offset)
    with pytest.raises(AuthError, match="stale"):
        verifier(max_skew_s=30).verify("GET", "/v1/health", headers, b"")


def test_timestamp_is_covered_by_the_signature():
    headers = sign(SECRET, "GET", "/v1/health", b"", AGENT_A)
    headers[TIMESTAMP_HEADER] = f"{float(headers[TIMESTAMP_HEADER]) + 1:.6f}"
    with pytest.raises(AuthError, match="bad signature"):
        verifier().verify("GET", "/v1/health", headers, b"")


def test_signatures_differ_per_request():
    a = sign(SECRET, "GET", "/v1/health", b"", AGENT_A)
    b = sign(SECRET, "GET", "/v1/health", b"", AGENT_A)
    assert a[NONCE_HEADER] != b[NONCE_HEADER]
    assert a[SIGNATURE_HEADER] != b[SIGNATURE_HEADER]
    assert len(new_incarnation()) == 32 and new_incarnation() != new_incarnation()


def test_load_secret_rules():
    secret = new_secret()
    assert load_secret(" " + secret + "\n") == secret.encode()
    assert len(load_secret(new_secret())) == 64
    with pytest.raises(ValueError, match="not set"):
        load_secret(None)
    with pytest.raises(ValueError, match="at least 16"):
        load_secret("short")
