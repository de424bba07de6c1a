"""Ports for the servers pdserve starts (engine/ports.py): free, different, and never from the
kernel's ephemeral range, which a process binding port 0 (or connecting) may be handed."""

from __future__ import annotations

import socket

from engine.ports import candidate_ports, ephemeral_range, free_port, free_ports


def test_ports_are_free_different_and_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(not low <= port <= high and port in candidate_ports() for port in ports)
    for port in ports:  # each one a server can bind now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_picked() -> None:
    """Every candidate but one held by this test: the one left is the one picked."""
    candidates = candidate_ports()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        ephemeral = probe.getsockname()[1]
    assert ephemeral not in candidates  # what port 0 gives is no candidate
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        assert port not in free_ports(20)
