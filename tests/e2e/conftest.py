"""The whole system as separate processes on loopback, on the real default model."""
import pytest

from specd_cli.stack import Stack, StackPorts


@pytest.fixture(scope="package")
def stack():
    stack = Stack(ports=StackPorts.free(), threads=2)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()
