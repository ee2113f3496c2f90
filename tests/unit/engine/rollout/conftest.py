"""The rollout worker tests' shared parts: a connected socket pair and the tiny model's backend."""

import socket

import pytest

from rlflow.engine.rollout.worker import HFBackend


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def backend(small_assets):
    return HFBackend(str(small_assets / "tiny-model"), "float32")
