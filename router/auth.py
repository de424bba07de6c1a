"""API keys: who may call the router's generation surfaces (HTTP and gRPC). Pure: no I/O here
but reading the keys file.

A keys file holds one key per line, hashed, never the key itself, and optionally its limits:

    # name  sha256 of the key, then limits if any
    alice   sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8
    batch   sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 rpm=600
    agent   sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae concurrency=4

`concurrency=N`: at most N of the key's requests in flight at once; `rpm=N`: at most N of its
requests started per minute. Both hold across all router replicas (router/key_limits.py), and a
request past either is refused like overload (HTTP 429 / RESOURCE_EXHAUSTED) naming the key.

`pdserve up` writes one for its run (0600, in the run folder) and prints the key once;
`pdserve keys new NAME` prints a new key and the line to add. Clients send the key as
`Authorization: Bearer <key>` (HTTP) or `authorization: Bearer <key>` metadata (gRPC); the
health endpoints stay open. A refusal is HTTP 401 with OpenAI's error body, or gRPC
UNAUTHENTICATED.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

KEY_PREFIX = "pds-"
_HASH = re.compile(r"sha256:[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def new_key() -> str:
    """A fresh key: 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def key_line(name: str, key: str) -> str:
    """The keys-file line for `key` under `name`."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"key name {name!r}: use 1-64 of A-Z a-z 0-9 _ . @ -")
    return f"{name} {hash_key(key)}"


def bearer_token(header: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` value; None when absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class Unauthenticated(Exception):
    """No key, or a key that is not in the keys file (HTTP 401 / gRPC UNAUTHENTICATED)."""


@dataclass(frozen=True)
class KeyLimits:
    """One key's limits; None: none of that kind."""

    max_concurrent: int | None = None  # requests in flight at once (`concurrency=`)
    max_per_minute: int | None = None  # requests started per clock minute (`rpm=`)

    @property
    def any(self) -> bool:
        return self.max_concurrent is not None or self.max_per_minute is not None


NO_LIMITS = KeyLimits()
_LIMIT_OPTIONS = {"concurrency": "max_concurrent", "rpm": "max_per_minute"}


def _parse_limits(options: list[str], where: str) -> KeyLimits:
    values: dict[str, int] = {}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in _LIMIT_OPTIONS:
            raise ValueError(
                f"{where}: unknown option {option!r} (limits are concurrency=N and rpm=N)"
            )
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{where}: {name} must be a whole number >= 1, got {value!r}")
        if _LIMIT_OPTIONS[name] in values:
            raise ValueError(f"{where}: {name} appears twice")
        values[_LIMIT_OPTIONS[name]] = int(value)
    return KeyLimits(**values)


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys as (name, "sha256:<hex>") pairs and the limits of those that have
    some; picklable, safe to hand to replicas (the hashes of 256-bit random keys reveal nothing
    usable)."""

    entries: tuple[tuple[str, str], ...]
    limits: tuple[tuple[str, KeyLimits], ...] = ()

    def __post_init__(self) -> None:
        if not self.entries:
            raise ValueError("an API keys file must hold at least one key")

    @classmethod
    def parse(cls, text: str, source: str = "keys file") -> ApiKeys:
        entries: list[tuple[str, str]] = []
        limits: list[tuple[str, KeyLimits]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) < 2 or not _NAME.fullmatch(parts[0]) or not _HASH.fullmatch(parts[1]):
                raise ValueError(
                    f"{source}, line {number}: expected '<name> sha256:<64 hex digits> "
                    "[concurrency=N] [rpm=N]' (keys are stored hashed; `pdserve keys new NAME` "
                    "prints the line)"
                )
            entries.append((parts[0], parts[1]))
            key_limits = _parse_limits(parts[2:], f"{source}, line {number}")
            if key_limits.any:
                limits.append((parts[0], key_limits))
        names = [name for name, _ in entries]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"{source}: key name {duplicate!r} appears twice")
        if not entries:
            raise ValueError(f"{source}: holds no key")
        return cls(tuple(entries), tuple(limits))

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"API keys file {path}: {exc.strerror or exc}") from None
        return cls.parse(text, f"API keys file {path}")

    @classmethod
    def of(cls, keys: Iterable[tuple[str, str]]) -> ApiKeys:
        """From (name, plain key) pairs (tests and `pdserve up`)."""
        return cls.parse("\n".join(key_line(name, key) for name, key in keys))

    def limits_of(self, name: str) -> KeyLimits:
        return next((limits for n, limits in self.limits if n == name), NO_LIMITS)

    def authenticate(self, key: str | None) -> str:
        """The name of `key`; raises Unauthenticated. Every entry is compared, in constant
        time, so the time taken says nothing about which hash came close."""
        if not key:
            raise Unauthenticated("missing API key")
        digest = hash_key(key)
        found = None
        for name, expected in self.entries:
            if hmac.compare_digest(digest, expected):
                found = name
        if found is None:
            raise Unauthenticated("invalid API key")
        return found
