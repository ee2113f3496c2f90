"""rollout.off_policy_steps = k: the replica samples the batch of step s+k while the trainer trains
step s, on a schedule that does not depend on timing.

Version v is the actor after v complete training steps. The replica holds version s-1 during step s
(it gets the weights after each step), and the batch of step s+k is submitted at the start of step
s, so batch t is sampled by version max(0, t-1-k): a pure function of t. What each step samples
(prompts, seeds) is a pure function of the step too (`plan`), so the batches already sampled when
a step commits (s+1 .. s+k, collected before the weights change) are all a resume needs: the
checkpoint keeps them (`state_dict`) and a restarted run trains on exactly the same samples.

    sampler = Lookahead(client, k, plan, last_step, version=0)
    sampled = sampler.take(step)       # submits steps up to step+k, waits for step's samples
    ...train step...
    sampler.drain()                    # everything submitted, collected: the replica is idle
    ...client.update_weights(...); sampler.version = step...
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.replica import Generation
from rlflow.engine.seeds import step_seed

# (chunk index, prompts, seed): one generate request of a step
ChunkSpan = tuple[int, Sequence[Sequence[int]], int]
PROBE = -1  # the queue's step of a weight-sync probe request


def chunk_spans(prompts: Sequence[Sequence[int]], seed: int, generate_batch: int) -> list[ChunkSpan]:
    """A step's prompts cut into generate requests of `generate_batch`; chunk c is seeded (seed, c),
    as colocated sampling seeds it."""
    n_chunks = -(-len(prompts) // generate_batch)
    return [(c, prompts[c * generate_batch : (c + 1) * generate_batch], step_seed(seed, c)) for c in range(n_chunks)]


@dataclass(frozen=True)
class StepPlan:
    """What the replica samples for one step."""

    chunks: list[ChunkSpan]
    params: SamplingParams


@dataclass(frozen=True)
class SampledStep:
    """A step's samples from the replica: one (response ids, log-probs) pair per chunk, in chunk order."""

    version: int  # the policy version the replica held: completed training steps
    chunks: list[tuple[list[list[int]], list[list[float]]]]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "chunks": [[ids, lps] for ids, lps in self.chunks]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SampledStep:
        return cls(int(data["version"]), [(ids, lps) for ids, lps in data["chunks"]])


def staleness_metrics(versions: torch.Tensor, trainer_version: int, bound: int) -> dict[str, float]:
    """rollout/staleness_mean and _max: versions the trainer's policy is ahead of each row's sampler.

    versions: [B] int64, the version that sampled each row; trainer_version: the version trained
    on them (step - 1). A row staler than `bound` is a bug in the schedule, never trained on."""
    staleness = (trainer_version - versions).float()
    worst = float(staleness.max())
    if worst > bound or float(staleness.min()) < 0:
        raise RuntimeError(
            f"rows sampled by versions {sorted(set(versions.tolist()))} reached training at version {trainer_version}:"
            f" staleness must lie in [0, {bound}] (rollout.off_policy_steps, or max_staleness with async)"
        )
    return {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": worst}


class Lookahead:
    """The replica's queue of steps ahead of the trainer, on rank 0 (see the module docstring).

    Requests are answered in order, so the outstanding queue is a FIFO of (step, chunks left).
    `waited_s` adds up the seconds the trainer blocked on the replica's samples."""

    def __init__(
        self,
        client: Any,  # the ReplicaFleet (engine/rollout/replicas.py)
        k: int,
        plan: Callable[[int], StepPlan],
        last_step: int,
        version: int,
        buffer: dict[int, SampledStep] | None = None,
    ):
        self.client, self.k, self.plan, self.last_step, self.version = client, k, plan, last_step, version
        self.buffer: dict[int, SampledStep] = dict(buffer or {})
        self.queue: deque[tuple[int, int]] = deque()  # (step, chunks) submitted, in order
        self.partial: list[tuple[list[list[int]], list[list[float]]]] = []  # the queue head's chunks so far
        self.submitted: set[int] = set(self.buffer)
        self.waited_s = 0.0
        self.probe: Generation | None = None  # the sync probe's samples, once collected

    def take(self, step: int) -> SampledStep:
        """Step `step`'s samples (removed from the buffer), after submitting every step up to step+k
        that is not yet submitted (none past last_step)."""
        for ahead in range(step, min(step + self.k, self.last_step) + 1):
            if ahead not in self.submitted:
                self._submit(ahead)
        while step not in self.buffer:
            if not self.queue:
                raise RuntimeError(f"step {step}'s samples were never submitted to the rollout replica")
            self._collect_one()
        return self.buffer.pop(step)

    def submit_probe(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> None:
        """A generate request outside the plan (the weight-sync probe), answered in its turn."""
        self.client.submit(prompts, params, seed)
        self.queue.append((PROBE, 1))
        self.probe = None

    def collect_probe(self) -> Generation:
        """The probe's samples (collecting the replies ahead of it first)."""
        while self.probe is None:
            if not any(step == PROBE for step, _ in self.queue):
                raise RuntimeError("collect_probe() with no probe submitted")
            self._collect_one()
        probe, self.probe = self.probe, None
        return probe

    def drain(self) -> None:
        """Collect everything submitted, so the replica is idle (before a weight update)."""
        while self.queue:
            self._collect_one()

    def _submit(self, step: int) -> None:
        plan = self.plan(step)
        for _, prompts, seed in plan.chunks:
            self.client.submit(prompts, plan.params, seed)
        self.queue.append((step, len(plan.chunks)))
        self.submitted.add(step)

    def _collect_one(self) -> None:
        started = time.monotonic()
        generation = self.client.collect()
        self.waited_s += time.monotonic() - started
        step, n_chunks = self.queue[0]
        if step == PROBE:
            self.queue.popleft()
            self.probe = generation
            return
        held = {v for row in generation.versions or [] for v in row}
        if held - {self.version}:  # the replica's own tag: the weights it sampled with
            raise RuntimeError(
                f"step {step}: the rollout replica sampled with policy version(s) {sorted(held)}, the schedule"
                f" expected {self.version}: a weight update reached it out of turn"
            )
        self.partial.append((generation.response_ids, generation.logprobs))
        if len(self.partial) == n_chunks:
            self.queue.popleft()
            self.buffer[step] = SampledStep(self.version, self.partial)
            self.partial = []

    def state_dict(self) -> dict[str, Any]:
        """The collected steps ahead of the trainer (call after `drain`): JSON, exact floats."""
        if self.queue:
            raise RuntimeError("Lookahead.state_dict with generations outstanding; drain() first")
        return {str(step): sampled.to_json() for step, sampled in sorted(self.buffer.items())}

    @staticmethod
    def buffer_from(state: dict[str, Any]) -> dict[int, SampledStep]:
        return {int(step): SampledStep.from_json(data) for step, data in state.items()}
