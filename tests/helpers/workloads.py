"""A PPO workload for the cost estimator's tests: a 64-prompt rollout batch of 512 + 512 tokens in
bf16 on one model shape for all four roles, with any field replaced."""

from dataclasses import replace

from rlflow.engine.estimate.model_shape import ModelShape
from rlflow.engine.estimate.workload import PRECISIONS, Workload

BF16 = PRECISIONS["bf16-mixed"]


def workload(shape: ModelShape, **changes) -> Workload:
    base = Workload(
        actor=shape,
        critic=shape,
        reference=shape,
        reward=shape,
        rollout_batch=64,
        prompt_tokens=512,
        response_tokens=512,
        mini_batch=32,
        epochs=1,
        steps=100,
        generate_batch=16,
        precision=BF16,
        micro_batch_size=4,
    )
    return replace(base, **changes)
