"""relay/launcher.py's ports for test and benchmark meshes: picked below the kernel's
ephemeral range, so that no outgoing connection takes a relay's port while it restarts."""

from __future__ import annotations

import socket

from relay.launcher import PICKED_PORTS_LOW, _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(40)
    assert len(set(ports)) == 40
    high = _ephemeral_low()
    if high > PICKED_PORTS_LOW:
        assert all(PICKED_PORTS_LOW <= port < high for port in ports), ports
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free again once chosen
