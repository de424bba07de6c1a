"""Ports for the servers pdserve starts (engine/ports.py): free, different, and never from the
kernel's ephemeral range, which a process binding port 0 (or connecting) may be handed."""

from __future__ import annotations

import socket

import pytest

from engine import ports
from engine.ports import candidate_ports, ephemeral_range, free_port, free_ports


def test_ports_are_free_different_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(not low <= port <= high and port in candidate_ports() for port in ports)
    for port in ports:  # each one a server can bind now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_port_zero_gives_no_candidate() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        assert probe.getsockname()[1] not in candidate_ports()


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two candidates left, the first held by this test: the second is the one picked, every
    time, and asking for both fails."""
    held_port = next(p for p in free_ports(20) if p + 1 in candidate_ports() and _free(p + 1))
    monkeypatch.setattr(ports, "candidate_ports", lambda: range(held_port, held_port + 2))
    with socket.socket() as held:
        held.bind(("127.0.0.1", held_port))
        held.listen()
        assert [free_port() for _ in range(10)] == [held_port + 1] * 10
        with pytest.raises(RuntimeError, match="no 2 free TCP ports"):
            free_ports(2)


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
