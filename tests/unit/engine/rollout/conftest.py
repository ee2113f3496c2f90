"""The rollout tests' shared parts: the tiny model's HF replica sampler, in this process."""

import pytest

from rlflow.engine.rollout.hf_sampler import HFModel


@pytest.fixture
def hf_model(small_assets):
    return HFModel(str(small_assets / "tiny-model"), "float32")
