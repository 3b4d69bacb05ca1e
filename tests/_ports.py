"""Free loopback ports for servers the tests start, chosen where no outgoing connection lands.

Binding port 0 returns a port from the kernel's ephemeral range — the same range the kernel
draws from for every outgoing connection's local port. Between handing such a port out and the
server binding it, any connection the tests make (a ZooKeeper probe, an HTTP ping) can take it,
and the server exits with "Address already in use" (it happened in CI: a cluster replica, code 70).
:func:`free_port` therefore picks from below the ephemeral range, where only explicit listeners
bind, and never hands the same port out twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Where Linux's ephemeral range starts when the kernel does not say.
DEFAULT_EPHEMERAL_LOW = 32768
#: The lowest port handed out: above the registered services most machines run.
LOWEST_PORT = 20000
ATTEMPTS = 200

_handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where /proc does not say)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def free_port() -> int:
    """A loopback port below the ephemeral range that nothing listens on and this process has not handed out."""
    high = ephemeral_low()
    if high <= LOWEST_PORT:
        raise RuntimeError(
            f"the ephemeral port range starts at {high} ({EPHEMERAL_RANGE_FILE}); "
            f"the tests need free ports in [{LOWEST_PORT}, {high}) for their servers"
        )
    for _ in range(ATTEMPTS):
        port = random.randrange(LOWEST_PORT, high)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in [{LOWEST_PORT}, {high}) after {ATTEMPTS} tries")
