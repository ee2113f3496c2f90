"""Several rollout replicas as one sampler: rows spread over the live ones, weights to all of them.

    fleet = ReplicaFleet([ReplicaClient(url, key, tokenizer, name=f"vllm-{i}") for i, url in enumerate(urls)])
    generation = fleet.generate(prompts, params, seed)      # row i still samples with row_seed(seed, i)
    fleet.update_weights(policy.named_parameters(), 256, version=3)

A replica that stops answering (its /health fails after a request failed) is dropped, with a warning
naming it, and its rows go to the others; a replica that answers but refuses (a malformed answer, a
version of another run) is an error, not a reason to drop it. With none left, the step fails naming
every replica; the stage's retry starts again from its last checkpoint. Each row's seed is its own,
so which replica samples a row does not change its tokens beyond what vLLM's batching moves.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.faults import armed
from rlflow.engine.rollout.replica import (
    MAX_PARALLEL_ROWS,
    ReplicaClient,
    ReplicaError,
    RowBatch,
    RowRequests,
    SyncStats,
    push_weights,
)

log = logging.getLogger(__name__)


class ReplicaFleet:
    def __init__(self, clients: Sequence[ReplicaClient], on_close: Callable[[], None] | None = None):
        if not clients:
            raise ValueError("a fleet needs at least one replica")
        self.clients = list(clients)
        self._on_close = on_close  # e.g. give the trainer back the replicas' cores
        self.dead: dict[str, str] = {}  # replica name -> why it was dropped
        self._rows = RowRequests(MAX_PARALLEL_ROWS * len(self.clients), "rollout fleet")
        self._lock = threading.Lock()
        self.generations = 0  # generate calls so far (RLFLOW_FAULT rollout:replica_kill:<n>)

    @property
    def live(self) -> list[ReplicaClient]:
        return [c for c in self.clients if c.name not in self.dead]

    @property
    def dtype(self) -> torch.dtype:
        return self.clients[0].dtype

    @property
    def tokenizer(self) -> Any:
        return self.clients[0].tokenizer

    # --- sampling --------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> Any:
        return self.collect(self.submit(prompts, params, seed))

    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int, *, priority: bool = False
    ) -> int:
        self.generations += 1
        if armed("rollout", "replica_kill", self.generations):  # the fault tests' replicas dying mid-step
            for client in self.clients:
                client.kill()
        return self._rows.submit(self._row, prompts, params, seed, self.tokenizer, priority)

    @property
    def outstanding(self) -> int:
        return len(self._rows.pending)

    def collect(self, request_id: int | None = None) -> Any:
        return self._rows.collect(request_id)

    def _row(self, index: int, prompt: list[int], batch: RowBatch) -> Any:
        while True:
            live = self.live
            if not live:  # whichever row's thread dropped them, every row's error names them all
                why = "; ".join(f"{name}: {reason}" for name, reason in self.dead.items())
                raise ReplicaError(f"rollout fleet: no replica left ({', '.join(self.dead)}); {why}")
            client = live[index % len(live)]
            try:
                # a batch spread over several replicas is no replica's batch: each row samples alone
                return client._generate_row(index, prompt, batch, hint=len(self.clients) == 1)
            except ReplicaError as exc:
                if client.health():
                    raise  # it answers: a refusal or a malformed answer, not a dead replica
                self._drop(client, str(exc))

    def _drop(self, client: ReplicaClient, why: str) -> None:
        with self._lock:
            if client.name in self.dead:
                return
            self.dead[client.name] = why
        log.warning("rollout replica %s dropped from the fleet, its rows go to the others: %s", client.name, why)

    def idle_s(self) -> float | None:
        """Seconds the live replicas have had nothing to sample, summed; None unless all of them say."""
        idle = [c.idle_s() for c in self.live]
        return None if None in idle else sum(idle)

    # --- weights ---------------------------------------------------------------------------------

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_mb: float = 256, *, version: int | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> SyncStats:
        """Every live replica gets the weights (a replica that dies during the update fails it: the
        stage stops, naming it; its rows were already served by the others). `meanwhile`: push_weights'."""
        return push_weights(self.live, named_tensors, bucket_mb, version, meanwhile=meanwhile)

    def fingerprint(self) -> str:
        """The replicas' common fingerprint; if they differ, all of them (the guard then fails naming them)."""
        prints = {c.name: c.fingerprint() for c in self.live}
        if len(set(prints.values())) == 1:
            return next(iter(prints.values()))
        return " / ".join(f"{name}={fp}" for name, fp in prints.items())

    def close(self) -> None:
        self._rows.close()
        for client in self.clients:
            client.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
