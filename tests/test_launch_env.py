"""Tests of the launcher-environment leaf: the rendezvous port it picks."""

from __future__ import annotations

import socket

from megatron_fp8 import launch_env
from megatron_fp8.launch_env import find_free_port, find_free_ports


def test_find_free_port_is_bindable_and_not_one_the_kernel_hands_out():
    ports = {find_free_port() for _ in range(8)}
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    low, high = launch_env._RENDEZVOUS_PORTS
    ephemeral_low = launch_env._ephemeral_low()
    if ephemeral_low - low >= 1024:  # Linux's default range leaves 20000-32767
        assert all(low <= p < min(high, ephemeral_low) for p in ports), ports
    assert len(ports) > 1  # drawn at random: concurrent picks rarely agree


def test_find_free_port_falls_back_to_the_os_where_the_kernel_leaves_no_room(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(launch_env, "_RENDEZVOUS_PORTS", (port, port + 1024))
        monkeypatch.setattr(launch_env, "_ephemeral_low", lambda: port + 1)  # a 1-port range: no draw
        assert find_free_port() != port  # bind(0) picks another


def test_find_free_ports_are_distinct(monkeypatch):
    draws = iter([30001, 30001, 30002, 30001, 30003])
    monkeypatch.setattr(launch_env, "find_free_port", lambda host: next(draws))
    assert find_free_ports(3) == (30001, 30002, 30003)
