"""The HF replica's sampler: rows gathered into the batches the trainer meant, sampled one batch at a
time by one thread, paused around weight updates.

A request is one row (vLLM's /inference/v1/generate shape). A row that names its batch (`BatchKey`:
the trainer's request id, its row count, seed and pad id) waits until every row of that batch has
arrived; the batch is then sampled exactly as colocated generation samples that chunk (one left-padded
batch, the batch's seed), so a replica with the trainer's weights gives the trainer's tokens bit for bit.
A row without one is a batch of its own, with its own seed. Complete batches go in arrival order, a
`priority` one (the sync probe) first.

`pause("wait")` stops new batches and returns once the running one is done; `pause("keep")` also cuts
the running one after its next token, and once resumed its unfinished rows go on under the new
weights (their prompt plus the tokens so far, prefilled again, a seed of their own): each row reports
the weight version of each of its token spans, so every token's behaviour policy is known.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rlflow.engine.faults import fault_point
from rlflow.engine.rollout.weight_sync import DTYPES, copy_tensor, weights_fingerprint

log = logging.getLogger("rlflow.hf_replica")
CONTINUATION_STREAM = 7919  # the seed stream of a partial rollout's continuations
PAUSE_MODES = ("wait", "keep")
INITIAL_VERSION = "default"  # as vLLM labels weights no update has named


class SamplerError(ValueError):
    """A request the replica understood but cannot carry out (answered 400 with this message)."""


@dataclass(frozen=True)
class BatchKey:
    """The trainer's batch a row belongs to: rows of one key are sampled together."""

    batch: str
    rows: int
    seed: int
    pad: int
    priority: bool = False


@dataclass(frozen=True)
class RowRequest:
    prompt: list[int]
    temperature: float
    top_p: float
    max_tokens: int
    seed: int  # the row's own seed (used when it is a batch of its own)
    stops: list[int]
    row: int = 0  # its index in its batch
    key: BatchKey | None = None


@dataclass
class RowResult:
    ids: list[int]
    logprobs: list[float]
    spans: list[dict[str, Any]]  # [{"version", "start", "end"}, ...] over ids


@dataclass
class _Batch:
    key: BatchKey
    rows: dict[int, tuple[RowRequest, Future]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.rows) == self.key.rows

    @property
    def abandoned(self) -> bool:
        """Every row that came was given up by its caller (timed out): the rest will not come."""
        return not self.complete and all(future.cancelled() for _, future in self.rows.values())


class HFModel:
    """A transformers causal LM on the CPU, sampling exactly like `generate_rollouts`."""

    def __init__(self, model_dir: str, dtype: str, trust_remote_code: bool = False):
        from rlflow.engine.models.loading import load_policy

        self.model = load_policy(model_dir, dtype=dtype, trust_remote_code=trust_remote_code).eval()
        self.dtype = DTYPES[dtype]
        self.params = dict(self.model.named_parameters())

    @torch.no_grad()
    def sample(
        self, prompts: list[list[int]], request: RowRequest, seed: int, pad: int, interrupt: Callable[[], bool]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Per row: the sampled ids up to and including its first stop, and their log-probs."""
        from rlflow.engine.config.sampling import SamplingParams
        from rlflow.engine.data.batching import left_pad
        from rlflow.engine.models.tokens import response_mask_from_ids
        from rlflow.engine.rollout.generate import sample_tokens

        ids, attention = left_pad(prompts, pad)
        params = SamplingParams(request.temperature, request.top_p, request.max_tokens)
        out = sample_tokens(self.model, ids, attention, params, request.stops, pad, seed, interrupt=interrupt)
        keep = response_mask_from_ids(out.tokens, request.stops).bool()
        return (
            [row[k].tolist() for row, k in zip(out.tokens, keep)],
            [row[k].tolist() for row, k in zip(out.logprobs, keep)],
        )

    @torch.no_grad()
    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, value in weights:
            param = self.params.get(name)
            if param is None:
                raise SamplerError(f"the replica's model has no parameter {name!r}: trainer and replica models differ")
            if param.shape != value.shape:
                shapes = f"{tuple(param.shape)}, the update {tuple(value.shape)}"
                raise SamplerError(f"parameter {name!r} has shape {shapes}")
            copy_tensor(param, value)

    def fingerprint(self) -> str:
        return weights_fingerprint(self.model.named_parameters())


class HFSampler:
    """One sampling thread over `model`; `submit` rows, `pause`/`resume` around weight updates."""

    def __init__(self, model: HFModel, timeout_s: float = 600.0):
        self.model, self.timeout_s = model, timeout_s
        self.cond = threading.Condition()
        self.batches: dict[Any, _Batch] = {}  # by key, in arrival order
        self.paused, self.mode = False, "wait"
        self.running = False  # sampling a batch (False again while a cut one is held for resume)
        self.rows_running = 0  # rows of the batch being sampled (held ones included)
        self.version = INITIAL_VERSION
        self.generations = 0  # batches sampled: the kill point "rollout:generate:<n>"
        self.idle_s = 0.0  # seconds with nothing to sample (timing_s/wait_train)
        self._loose = 0  # rows without a batch key so far (each its own batch)
        threading.Thread(target=self._loop, name="hf-sampler", daemon=True).start()

    # --- requests ----------------------------------------------------------------------------------

    def submit(self, request: RowRequest) -> Future:
        future: Future = Future()
        with self.cond:
            for name in [k for k, b in self.batches.items() if b.abandoned]:  # they would wait forever
                del self.batches[name]
            if request.key is None:
                self._loose += 1
                key = BatchKey(f"row-{self._loose}", 1, request.seed, 0)
                name: Any = key.batch
                request = dataclasses.replace(request, row=0, key=key)
            else:
                key, name = request.key, (request.key.batch, request.key.rows)
            batch = self.batches.setdefault(name, _Batch(key))
            if not 0 <= request.row < key.rows or request.row in batch.rows:
                what = f"row {request.row} of batch {key.batch!r} ({key.rows} rows)"
                raise SamplerError(f"{what} is out of range or was sent twice")
            batch.rows[request.row] = (request, future)
            self.cond.notify_all()
        return future

    def pause(self, mode: str) -> None:
        """Stop sampling: `wait` lets the running batch finish, `keep` cuts it at its next token (it goes
        on after `resume`). Returns once nothing samples."""
        if mode not in PAUSE_MODES:
            raise SamplerError(f"pause mode {mode!r} is not served by the HF replica; use one of {list(PAUSE_MODES)}")
        with self.cond:
            self.paused, self.mode = True, mode
            if not self.cond.wait_for(lambda: not self.running, self.timeout_s):
                raise SamplerError(f"the running batch did not stop within {self.timeout_s:g} s")

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def require_paused(self, what: str) -> None:
        with self.cond:
            if not self.paused or self.running:
                raise SamplerError(f"{what} needs a paused replica: POST /pause first")

    # --- the sampling thread -------------------------------------------------------------------------

    def _next(self) -> _Batch:
        with self.cond:
            waited = time.monotonic()
            while True:
                ready = [(k, b) for k, b in self.batches.items() if b.complete] if not self.paused else []
                if ready:
                    name, batch = next(((k, b) for k, b in ready if b.key.priority), ready[0])
                    del self.batches[name]
                    self.running, self.rows_running = True, batch.key.rows
                    self.idle_s += time.monotonic() - waited
                    return batch
                self.cond.wait()

    def _loop(self) -> None:
        while True:
            batch = self._next()
            rows = [batch.rows[i] for i in range(batch.key.rows)]
            try:
                self.generations += 1
                fault_point("rollout", "generate", self.generations)
                results = self._sample([r for r, _ in rows], batch.key)
            except BaseException as exc:  # noqa: BLE001 - every row's caller gets the error
                log.exception("sampling batch %s failed", batch.key.batch)
                for _, future in rows:
                    if not future.cancelled():  # a row whose caller gave up waiting
                        future.set_exception(exc)
            else:
                for (_, future), result in zip(rows, results):
                    if not future.cancelled():
                        future.set_result(result)
            finally:
                with self.cond:
                    self.running, self.rows_running = False, 0
                    self.cond.notify_all()

    def _cut(self) -> bool:
        return self.paused and self.mode == "keep"

    def _sample(self, requests: list[RowRequest], key: BatchKey) -> list[RowResult]:
        """Sample the batch; cut by a pause(keep), hold until resumed, then go on with the rows left."""
        first = requests[0]
        budget = first.max_tokens
        prompts = [r.prompt for r in requests]
        ids, logprobs = self.model.sample(prompts, first, key.seed, key.pad, self._cut)
        spans = [[[0, len(row), self.version]] for row in ids]
        stops = [[s] for s in first.stops]  # a row ended at a stop id ends with one of these
        part = 0
        while going := [i for i, row in enumerate(ids) if len(row) < budget and row[-1:] not in stops]:
            self._hold()  # rows short of their budget without a stop id: cut by pause(keep)
            part += 1
            done = len(ids[going[0]])  # rows going on were all cut after the same token
            rest = dataclasses.replace(first, max_tokens=budget - done)
            seed = _continuation_seed(key.seed, part)
            more_ids, more_lps = self.model.sample(
                [prompts[i] + ids[i] for i in going], rest, seed, key.pad, self._cut
            )
            for i, row_ids, row_lps in zip(going, more_ids, more_lps):
                spans[i].append([len(ids[i]), len(ids[i]) + len(row_ids), self.version])
                ids[i] += row_ids
                logprobs[i] += row_lps
        return [
            RowResult(i, lp, [{"version": v, "start": a, "end": b} for a, b, v in s if b > a])
            for i, lp, s in zip(ids, logprobs, spans)
        ]

    def _hold(self) -> None:
        """A batch cut by pause(keep): let the update run, and go on once resumed."""
        with self.cond:
            self.running = False
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: not self.paused, self.timeout_s):
                raise SamplerError(f"the replica was not resumed within {self.timeout_s:g} s of a pause")
            self.running = True


def _continuation_seed(seed: int, part: int) -> int:
    from rlflow.engine.seeds import step_seed

    return step_seed(seed, CONTINUATION_STREAM, part)
