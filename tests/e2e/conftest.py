"""The whole system as separate processes on loopback, on the real default model."""
import socket

import pytest

from specd.stack import Stack, StackPorts


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="package")
def stack():
    stack = Stack(ports=StackPorts(*_free_ports(6)), threads=2)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()
