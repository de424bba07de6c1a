"""API keys (router/auth.py): the keys file, bearer parsing, the check, and where `--no-auth` is
allowed."""

from __future__ import annotations

import hashlib

import pytest

from api.client import API_KEY_ENV, _call_options
from deploy.up import check_no_auth_allowed
from router.auth import ApiKeys, Unauthenticated, bearer_token, hash_key, key_line, new_key


def test_new_keys_are_long_random_and_stored_as_their_sha256() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    key = keys.pop()
    assert key.startswith("pds-") and len(key) >= 40
    assert hash_key(key) == "sha256:" + hashlib.sha256(key.encode()).hexdigest()
    assert key_line("alice", key) == f"alice {hash_key(key)}"
    assert key not in key_line("alice", key)


def test_the_file_names_each_key_and_the_check_returns_the_name() -> None:
    alice, bob = new_key(), new_key()
    text = f"# team keys\n{key_line('alice', alice)}\n\n{key_line('bob', bob)}  # CI\n"
    keys = ApiKeys.parse(text)
    assert keys.authenticate(alice) == "alice"
    assert keys.authenticate(bob) == "bob"
    for wrong in (None, "", new_key(), alice + "x", alice[:-1], hash_key(alice)):
        with pytest.raises(Unauthenticated):
            keys.authenticate(wrong)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("alice pds-plaintext-key\n", "line 1"),  # a key in clear is refused, not accepted
        (f"alice {hash_key('k')}\nbad name {hash_key('j')}\n", "line 2"),
        (f"alice sha256:{'0' * 63}\n", "line 1"),
        (f"alice {hash_key('a')}\nalice {hash_key('b')}\n", "'alice' appears twice"),
        ("# only a comment\n", "holds no key"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ApiKeys.parse(text)


def test_a_missing_keys_file_is_named() -> None:
    with pytest.raises(ValueError, match="API keys file /nonexistent/keys"):
        ApiKeys.load("/nonexistent/keys")


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer abc", "abc"),
        ("bearer   abc ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("abc", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header: str | None, key: str | None) -> None:
    assert bearer_token(header) == key


def test_clients_send_the_key_as_authorization_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _call_options("app", 5, None) == {"metadata": (("application", "app"),), "timeout": 5}
    assert _call_options(None, None, "k1")["metadata"] == (("authorization", "Bearer k1"),)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _call_options("app", None, None)["metadata"] == (
        ("application", "app"),
        ("authorization", "Bearer from-env"),
    )
    assert _call_options(None, None, "given")["metadata"] == (("authorization", "Bearer given"),)


def test_no_auth_only_when_every_listener_is_on_loopback() -> None:
    check_no_auth_allowed({"HTTP": "127.0.0.1", "gRPC": "::1"})
    check_no_auth_allowed({"HTTP": "localhost"})
    with pytest.raises(ValueError, match="gRPC on ::"):
        check_no_auth_allowed({"HTTP": "127.0.0.1", "gRPC": "::"})
    with pytest.raises(ValueError, match=r"HTTP on 0\.0\.0\.0"):
        check_no_auth_allowed({"HTTP": "0.0.0.0"})
    # Local mode as it is: both proxies on loopback (Serve's gRPC proxy through
    # api/grpc_listener.py), so keys may be turned off.
    check_no_auth_allowed()
