"""The ports the tests give their servers, and what a server that cannot bind one says."""

from __future__ import annotations

import socket

import pytest

from tests._clickhouse import LocalServerProcess, find_server_binary
from tests._ports import LOWEST_PORT, ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST_PORT <= port < ephemeral_low() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


@pytest.mark.live
def test_a_server_whose_port_is_taken_says_so(tmp_path):
    binary = find_server_binary()
    if binary is None:
        pytest.skip("no clickhouse-server binary installed (Debian: apt-get install clickhouse-server)")
    process = LocalServerProcess(binary)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", process.tcp_port))
        squatter.listen()
        with pytest.raises(RuntimeError, match=rf"exited with code \d+ before answering .*Address already in use.*"
                                               rf":{process.tcp_port}"):
            process.start()
    assert not process.directory.exists()
