"""Free loopback ports, for services started beside whatever else runs (tests, benchmarks)."""
from __future__ import annotations

import socket


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on right now (bound together, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
