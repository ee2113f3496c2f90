"""rollout.async: the replica samples without pause into a bounded buffer; each step takes its groups.

The stream is endless: group g is rollout.n samples of prompt `prompt_of(g)`. Requests of a few
groups go to the replica as far as the staleness bound S allows, so sampling runs while the
trainer trains and weight updates go out without waiting for it. Version v is the actor after v
training steps; step s trains with version s-1, and a row's version is its oldest token's (a
partial rollout spans several).

Why nothing trained is staler than S: with the replica at version V (every submission follows
the sync of V) and T groups trained, a group submitted when (V + S + 1)·B − T groups are already
outstanding (ready or in flight) would be trained at step V + S + 2 or later, S + 1 versions behind
at least; so no more are submitted (B = groups per step). A group that still lags more when taken
(the bound lowered on resume) is dropped and counted.

What a resume keeps (`state_dict`): the ready groups (token ids, per-token log-probs and
versions), the stream position and a ledger of every group's fate. Generations in flight at the
checkpoint were never committed: a resumed run skips them and counts them as discarded.

    sampler = AsyncSampler(client, prompt_of, params, GroupShape(n, B, per_request), S, partial, 0, last_step)
    sampler.top_up()                        # after each weight sync
    taken = sampler.take(step)              # B groups, oldest first; submits more while it trains
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.replica import Generation
from rlflow.engine.seeds import step_seed

FATES = ("trained", "dropped", "discarded")  # what became of each group before the stream position


@dataclass(frozen=True)
class GroupShape:
    size: int  # rollout.n samples per prompt
    per_step: int  # B: groups a step trains on (rl.rollout_batch)
    per_request: int  # groups one generate request carries


@dataclass(frozen=True)
class TakenGroups:
    """One step's groups as the trainer takes them: group_size consecutive rows per group."""

    groups: list[int]  # stream positions, oldest first
    response_ids: list[list[int]]  # [rows] of token ids, each ending at its EOS or the length limit
    logprobs: list[list[float]]  # the sampler's log-prob of each token (the behaviour policy)
    versions: list[list[int]]  # the policy version that sampled each token

    def to_json(self) -> dict[str, Any]:
        return {"groups": self.groups, "ids": self.response_ids, "logprobs": self.logprobs, "versions": self.versions}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TakenGroups:
        return cls(list(data["groups"]), data["ids"], data["logprobs"], data["versions"])

    def generation(self, rows: slice) -> Generation:
        return Generation(self.response_ids[rows], self.logprobs[rows], self.versions[rows])

    def split(self, size: int) -> list[TakenGroups]:
        """One TakenGroups per group (`size` rows each)."""
        rows = (self.response_ids, self.logprobs, self.versions)
        return [
            TakenGroups([g], *(part[i * size : (i + 1) * size] for part in rows)) for i, g in enumerate(self.groups)
        ]

    @classmethod
    def join(cls, parts: Sequence[TakenGroups]) -> TakenGroups:
        fields = ("groups", "response_ids", "logprobs", "versions")
        return cls(*([x for p in parts for x in getattr(p, name)] for name in fields))


def oldest_version(versions: Sequence[Sequence[int]]) -> int:
    return min(v for row in versions for v in row)


class AsyncSampler:
    """The replica's continuous stream on rank 0 (see the module docstring). `waited_s` adds up
    the seconds the trainer blocked on samples."""

    def __init__(
        self,
        client: Any,  # the ReplicaFleet (engine/rollout/replicas.py)
        prompt_of: Callable[[int], Sequence[int]],
        params: SamplingParams,
        shape: GroupShape,
        max_staleness: int,
        partial: bool,
        version: int,
        last_step: int,
        seed: int = 0,
        state: dict[str, Any] | None = None,
    ):
        self.client, self.prompt_of, self.params, self.shape = client, prompt_of, params, shape
        self.max_staleness, self.partial, self.version, self.seed = max_staleness, partial, version, seed
        self.last_step = last_step  # no group is sampled that the last step would not train
        self.ready: deque[TakenGroups] = deque()  # one group each, in stream order
        self.inflight: deque[tuple[int, list[int]]] = deque()  # (request id, groups), in submission order
        self.next_group = 0
        self.fates: dict[str, list[int]] = {fate: [] for fate in FATES}
        self.last_taken: tuple[int, TakenGroups] | None = None
        self.discarded_on_resume = self.dropped = self.buffered = 0
        self.waited_s = 0.0
        if state:
            self._restore(state)

    @property
    def outstanding(self) -> int:
        """Groups ready or in flight."""
        return len(self.ready) + sum(len(groups) for _, groups in self.inflight)

    def top_up(self, taking: int = 0) -> None:
        """Submit groups while the bound allows (`taking`: groups taken off the buffer, not yet counted)."""
        trained = len(self.fates["trained"]) + taking
        bound = min(self.version + self.max_staleness + 1, self.last_step) * self.shape.per_step
        room = bound - trained - self.outstanding
        while room > 0:
            groups = list(range(self.next_group, self.next_group + min(room, self.shape.per_request)))
            prompts = [self.prompt_of(g) for g in groups for _ in range(self.shape.size)]
            request = self.client.submit(prompts, self.params, step_seed(self.seed, groups[0]))
            self.inflight.append((request, groups))
            self.next_group += len(groups)
            room -= len(groups)

    def take(self, step: int) -> TakenGroups:
        """Step `step`'s B groups (trained by version step-1), oldest first; a group staler than
        the bound is dropped. Tops the buffer up before returning, so the replica samples on."""
        taken: list[TakenGroups] = []
        self.buffered = len(self.ready)
        while len(taken) < self.shape.per_step:
            if not self.ready:
                self.top_up(len(taken))
                if not self.inflight:
                    raise RuntimeError(f"step {step}: no samples in flight and none may start (rollout.max_staleness)")
                self._collect_one()
                continue
            group = self.ready.popleft()
            if step - 1 - oldest_version(group.versions) > self.max_staleness:
                self.fates["dropped"] += group.groups
                self.dropped += 1
            else:
                taken.append(group)
        self.fates["trained"] += [g for group in taken for g in group.groups]
        self.top_up()
        joined = TakenGroups.join(taken)
        self.last_taken = (step, joined)
        return joined

    def _collect_one(self) -> None:
        request, groups = self.inflight.popleft()
        started = time.monotonic()
        generation = self.client.collect(request)
        self.waited_s += time.monotonic() - started
        if generation.versions is None:
            raise RuntimeError("the rollout replica's reply carries no token versions; asynchronous rollout needs them")
        self.ready.extend(TakenGroups(groups, *generation).split(self.shape.size))

    def metrics(self) -> dict[str, float]:
        """The last take's figures: groups ready when it began, groups dropped as too stale and
        discarded at the resume (this run, cumulative), and the share of rows a partial rollout
        sampled with more than one version."""
        rows = self.last_taken[1].versions if self.last_taken is not None else []
        return {
            "rollout/buffer_groups": float(self.buffered),
            "rollout/partial_rows": sum(len(set(row)) > 1 for row in rows) / max(len(rows), 1),
            "rollout/dropped_stale": float(self.dropped),
            "rollout/discarded_on_resume": float(self.discarded_on_resume),
        }

    def state_dict(self) -> dict[str, Any]:
        """The buffer a checkpoint commits (JSON, exact floats). Groups taken for a step not yet
        trained (version below it: a pause before the update) go back to the buffer's front."""
        ready, trained = list(self.ready), list(self.fates["trained"])
        if self.last_taken is not None and self.last_taken[0] > self.version:
            untrained = self.last_taken[1]
            trained = trained[: len(trained) - len(untrained.groups)]
            ready = untrained.split(self.shape.size) + ready
        inflight = [g for _, groups in self.inflight for g in groups]
        fates = self.fates | {"trained": trained}
        return {
            "next_group": self.next_group,
            "ready": [group.to_json() for group in ready],
            "in_flight": to_ranges(inflight),
            "fates": {fate: to_ranges(ids) for fate, ids in fates.items()},
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.next_group = int(state["next_group"])
        self.ready = deque(TakenGroups.from_json(data) for data in state["ready"])
        self.fates = {fate: from_ranges(state["fates"][fate]) for fate in FATES}
        lost = from_ranges(state["in_flight"])
        self.fates["discarded"] += lost
        self.discarded_on_resume = len(lost)


def to_ranges(ids: Sequence[int]) -> list[list[int]]:
    """[3, 4, 5, 9] -> [[3, 6], [9, 10]]: half-open runs, in order (a ledger of long runs stays small)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def from_ranges(runs: Sequence[Sequence[int]]) -> list[int]:
    return [i for start, end in runs for i in range(start, end)]
