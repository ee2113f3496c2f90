"""PPO's rollouts from rollout replicas (`rollout.mode: server`), with the sync guard.

Rank 0 owns the replica. It samples every chunk of a step (chunk c with the same seed colocated
sampling would use), and each rank takes its chunks' token ids. After every optimizer step the
actor's weights go to the replica in buckets; the trainer then compares weight fingerprints and
the replica's log-probs against its own under the same weights: a skipped or partial sync stops
the run. Synchronously (off_policy_steps 0) the probe is every sampled row, whose trainer
log-probs PPO computes anyway as its old log-probs; off-policy and asynchronously, the sampled rows
are older than the trainer's weights, so a few rows sampled right after the sync are rescored
instead. Asynchronously (rollout.async) the replica samples on while the weights go out
(engine/rollout/streaming.py), and each step trains on the groups its buffer holds.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import TrainEngine
from rlflow.engine.config.execution import RolloutConfig
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.faults import fault_point
from rlflow.engine.rollout.generate import RolloutBatch, batched_logprobs
from rlflow.engine.rollout.lookahead import Lookahead, SampledStep, StepPlan
from rlflow.engine.rollout.streaming import AsyncSampler, GroupShape, TakenGroups
from rlflow.engine.seeds import step_seed
from rlflow.engine.telemetry.phases import add_phases
from rlflow.engine.rollout.weight_sync import check_weight_sync, weights_fingerprint


@dataclass
class RolloutService:
    cfg: RolloutConfig
    client: Any = None  # the ReplicaFleet (engine/rollout/replicas.py) on rank 0, None elsewhere
    tokenizer: Any = None
    trainer_fingerprint: str | None = None  # at the last sync (rank 0)
    replica_fingerprint: str | None = None
    lookahead: Lookahead | None = None  # off_policy_steps > 0, rank 0: the steps sampled ahead
    plan: Callable[[int], StepPlan] | None = None  # samples_ahead: what each step samples (its probe)
    stream: AsyncSampler | None = None  # rollout.async, rank 0: the continuous stream
    version: int = 0  # the policy version the replica holds (completed training steps)
    taken: tuple[int, SampledStep | TakenGroups] | None = None  # the last step's samples (a step run again reuses them)
    replica_idle_s: float | None = None  # the replicas' idle seconds, cumulative, at the last report
    probe: tuple[list, SamplingParams] | None = None  # off-policy: the probe sent after the last sync
    probe_id: int | None = None  # async: its request id
    probe_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # its check's figures

    @classmethod
    def start(
        cls,
        cfg: RolloutConfig,
        model_dir: str,
        tokenizer: Any,
        actor: TrainEngine,
        log_path: str | None,
        cuda_visible_devices: str | None = None,
        ahead: AheadStart | None = None,
    ):
        """Start the replica on rank 0 (on `cuda_visible_devices`: placement.rollout) and send it
        the actor's current weights (a resumed actor differs from `model_dir`). With
        cfg.off_policy_steps > 0, `ahead` says what each step samples and where the run stands.
        A collective under ZeRO-3."""
        client = None
        if dist.is_main():
            from rlflow.engine.rollout.replicas import start_sampler

            client = start_sampler(cfg, model_dir, tokenizer, log_path, cuda_visible_devices)
        service = cls(cfg, client, tokenizer)
        service.replica_idle_s = client.idle_s() if client is not None else None
        if cfg.samples_ahead:
            if ahead is None:
                raise ValueError("rollout.off_policy_steps > 0 and rollout.async need the step plan (AheadStart)")
            service.plan, service.version = ahead.plan, ahead.version
            if client is not None and cfg.async_:
                shape = GroupShape(cfg.n, ahead.batch_groups, max(1, cfg.generate_batch // cfg.n))
                params, S = ahead.plan(1).params, cfg.max_staleness
                state = ahead.buffer.get("async")
                partial, version, last = cfg.partial_rollouts, ahead.version, ahead.last_step
                service.stream = AsyncSampler(
                    client, ahead.prompt_of, params, shape, S, partial, version, last, ahead.seed, state
                )
            elif client is not None:
                buffer = Lookahead.buffer_from(ahead.buffer)
                k, last = cfg.off_policy_steps, ahead.last_step
                service.lookahead = Lookahead(client, k, ahead.plan, last, ahead.version, buffer)
        version = ahead.version if ahead is not None else 0
        service.sync(actor, version, version)
        return service

    @property
    def checks_batches(self) -> bool:
        """Whether each sampled batch is the sync guard's probe: synchronous sampling, where the
        replica sampled with the very weights the trainer scores it with."""
        return not self.cfg.samples_ahead

    def sample_chunks(
        self, chunks: Sequence[tuple[int, Sequence[Sequence[int]], int]], params: SamplingParams, step: int = 0
    ) -> dict[int, RolloutBatch]:
        """chunks: (chunk index, prompts, seed) of the whole step, the same list on every rank.
        Returns this rank's chunks (index c with c % world == rank) as RolloutBatches. Off-policy,
        the samples are the lookahead's for `step` (sampled to the same plan, by an older version);
        asynchronously, those of the groups `take_groups(step)` took (each row as old as its oldest token)."""
        from rlflow.engine.rollout.served import build_rollout_batch
        from rlflow.engine.rollout.replica import Generation

        if self.cfg.async_:  # the groups take_groups(step) took, cut as the chunks cut their prompts
            taken, starts = self.taken[1], [0, *itertools.accumulate(len(p) for _, p, _ in chunks)]
            version, generations = None, [taken.generation(slice(a, b)) for a, b in zip(starts, starts[1:])]
        else:
            if self.cfg.off_policy_steps:
                version, sampled, logprobs = self._take(step)
            else:
                version, sampled, logprobs = self.version, [], []
                if self.client is not None:
                    for _, prompts, seed in chunks:
                        generation = self.client.generate(prompts, params, seed)
                        sampled.append(generation.response_ids)
                        logprobs.append(generation.logprobs)
                if dist.world_size() > 1:  # rank 0 hands every rank the token ids of all chunks
                    sampled, logprobs = dist.all_gather_json([sampled, logprobs] if dist.is_main() else None)[0]
            generations = [Generation(ids, lps) for ids, lps in zip(sampled, logprobs)]
        if len(generations) != len(chunks):
            raise RuntimeError(f"step {step}: the replica returned {len(generations)} chunks, {len(chunks)} requested")
        mine: dict[int, RolloutBatch] = {}
        for (c, prompts, _), generation in zip(chunks, generations):
            if c % dist.world_size() == dist.rank():
                mine[c] = build_rollout_batch(self.tokenizer, prompts, generation, params.max_new_tokens, version)
        return mine

    def _take(self, step: int) -> tuple[int, list, list]:
        """Step `step`'s samples from the lookahead (rank 0), on every rank: (version, ids, log-probs)."""
        if self.taken is not None and self.taken[0] == step:  # the step runs again (reward fallback)
            taken = self.taken[1]
        elif self.lookahead is not None:
            waited = self.lookahead.waited_s
            taken = self.lookahead.take(step)
            add_phases({"timing_s/wait_rollout": self.lookahead.waited_s - waited})
        else:
            taken = None
        if dist.world_size() > 1:
            data = dist.all_gather_json(taken.to_json() if taken is not None else None)[0]
            taken = SampledStep.from_json(data)
        self.taken = (step, taken)
        return taken.version, [ids for ids, _ in taken.chunks], [lps for _, lps in taken.chunks]

    def take_groups(self, step: int) -> list[int]:
        """rollout.async: the stream positions of the groups step `step` trains on, oldest first,
        on every rank (their samples wait for `sample_chunks`); a step run again gets the same."""
        if self.taken is None or self.taken[0] != step:
            taken = None
            if self.stream is not None:
                waited = self.stream.waited_s
                taken = self.stream.take(step)
                add_phases({"timing_s/wait_rollout": self.stream.waited_s - waited} | self.stream.metrics())
            if dist.world_size() > 1:
                taken = TakenGroups.from_json(dist.all_gather_json(taken.to_json() if taken is not None else None)[0])
            self.taken = (step, taken)
        return self.taken[1].groups

    def check(self, batch: RolloutBatch, trainer_logprobs: torch.Tensor) -> tuple[float, float, float]:
        """Guard one chunk: the trainer's log-probs [b, R] of the replica's samples (PPO's old
        log-probs) against the replica's own (batch.sampled_logprobs); fingerprints too (rank 0,
        once after each sync). Raises WeightSyncError; returns (sum of |diff| in nats, tokens, max |diff|)."""
        compare_fingerprints = self.cfg.check_fingerprint and self.trainer_fingerprint is not None
        result = check_weight_sync(
            self.trainer_fingerprint,
            self.replica_fingerprint,
            trainer_logprobs,
            batch.sampled_logprobs,
            batch.response_mask,
            self.cfg.logprob_diff_stop,
            compare_fingerprints,
        )
        self.trainer_fingerprint = self.replica_fingerprint = None  # compared: until the next sync
        return result.logprob_diff_mean * result.tokens, float(result.tokens), result.logprob_diff_max

    @staticmethod
    def metrics(parts: list[tuple[float, float, float]]) -> dict[str, float]:
        """rollout/logprob_diff_mean and _max over every rank's chunks of a step."""
        total = dist.all_reduce_sum(torch.tensor([sum(p[0] for p in parts), sum(p[1] for p in parts)]))
        worst = max(dist.all_gather_json(max((p[2] for p in parts), default=0.0)))
        return {
            "rollout/logprob_diff_mean": float(total[0]) / max(float(total[1]), 1.0),
            "rollout/logprob_diff_max": worst,
        }

    def sync(self, actor: TrainEngine, version: int, step: int = 0) -> dict[str, float]:
        """Send the actor's weights (policy version `version`) to the replica; record both
        fingerprints; off-policy, first collect what the replica sampled ahead, and after them send
        the probe of the new weights (`verify_sync`). Asynchronously the replica takes them between
        two generations (or two tokens: partial rollouts), the probe goes first after them and the
        stream is topped up. A collective under ZeRO-3."""
        metrics: dict[str, float] = {}
        if self.lookahead is not None:  # the replica finishes the steps ahead with the old weights
            waited = self.lookahead.waited_s
            metrics["timing_s/gen"] = timed_call(self.lookahead.drain)
            metrics["timing_s/wait_rollout"] = self.lookahead.waited_s - waited
        started = time.monotonic()
        params = _fault_after_first(actor.named_full_parameters(), step)
        if self.client is None:
            for _ in params:  # ZeRO-3: every rank takes part in each parameter's gather
                pass
            if self.cfg.check_fingerprint:
                for _ in actor.named_full_parameters():
                    pass
        else:

            def own() -> None:  # the trainer hashes its weights while the replicas hash theirs
                params, dtype = actor.named_full_parameters(), self.client.dtype
                self.trainer_fingerprint = weights_fingerprint(params, round_to=dtype)

            meanwhile = own if self.cfg.check_fingerprint else None
            stats = self.client.update_weights(params, self.cfg.bucket_mb, version=version, meanwhile=meanwhile)
            metrics |= {"timing_s/update_weights": time.monotonic() - started} | stats.metrics()
            if self.cfg.check_fingerprint:
                self.replica_fingerprint = self.client.fingerprint()
        self.version = version
        if self.lookahead is not None:
            self.lookahead.version = version
        if self.cfg.samples_ahead:
            self._submit_probe(step)
        if self.stream is not None:
            self.stream.version = version
            self.stream.top_up()
        return metrics

    def _submit_probe(self, step: int) -> None:
        """The guard of an off-policy sync, sent right behind the weights: the replica samples
        `probe_rows` prompts of step+1's plan with them, ahead of anything else; `verify_sync`
        rescores them before the trainer's next update, when its weights are still these."""
        plan = self.plan(step + 1)
        _, prompts, seed = plan.chunks[0]
        params = dataclasses.replace(plan.params, max_new_tokens=min(plan.params.max_new_tokens, PROBE_TOKENS))
        self.probe = (list(prompts[: self.cfg.probe_rows]), params)
        self.probe_metrics = {}
        if self.lookahead is not None:
            self.lookahead.submit_probe(self.probe[0], params, step_seed(seed, PROBE_STREAM))
        elif self.stream is not None:  # ahead of the generations queued: sampled by these weights
            self.probe_id = self.client.submit(self.probe[0], params, step_seed(seed, PROBE_STREAM), priority=True)

    def verify_sync(self, actor: TrainEngine) -> dict[str, float]:
        """Off-policy, before the update: the trainer's log-probs of the probe the replica sampled
        after the last sync, under the same weights (the actor is not updated since). Raises
        WeightSyncError; returns rollout/logprob_diff_mean and _max (the same again if the step runs
        again) and times timing_s/sync_probe. Synchronous: nothing (every batch is checked)."""
        from rlflow.engine.rollout.served import build_rollout_batch
        from rlflow.engine.rollout.replica import Generation

        if self.probe is None:
            return dict(self.probe_metrics)
        started = time.monotonic()
        (prompts, params), sampled = self.probe, None
        if self.client is not None:
            lookahead = self.lookahead
            generation = lookahead.collect_probe() if lookahead is not None else self.client.collect(self.probe_id)
            held = {v for row in generation.versions or [] for v in row}
            if held - {self.version}:
                raise RuntimeError(
                    f"the weight-sync probe was sampled by policy version(s) {sorted(held)}, not the synced"
                    f" {self.version}: the replica applied the weights out of turn"
                )
            sampled = [generation.response_ids, generation.logprobs]
        if dist.world_size() > 1:
            sampled = dist.all_gather_json(sampled)[0]
        batch = build_rollout_batch(self.tokenizer, prompts, Generation(*sampled), params.max_new_tokens)
        with torch.no_grad():
            trainer_logprobs = batched_logprobs(actor.forward, batch, params.temperature)
        self.probe = None
        self.probe_metrics = self.metrics([self.check(batch, trainer_logprobs)])
        add_phases({"timing_s/sync_probe": time.monotonic() - started})
        return dict(self.probe_metrics)

    def idle_metrics(self) -> dict[str, float]:
        """timing_s/wait_train: seconds the replicas sat idle since the last call (rank 0's view; only
        replicas that report it: the HF replica)."""
        if self.client is None:
            return {}
        before, self.replica_idle_s = self.replica_idle_s, self.client.idle_s()
        if before is None or self.replica_idle_s is None:
            return {}
        return {"timing_s/wait_train": self.replica_idle_s - before}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (rank 0): the samples of every step not yet trained on, the one
        taken but not trained on too (a pause before the update commits its previous step)."""
        if self.stream is not None:
            return {"async": self.stream.state_dict()}
        if self.lookahead is None:
            return {}
        self.lookahead.drain()
        state = self.lookahead.state_dict()
        if self.taken is not None and self.taken[0] > self.version:
            state[str(self.taken[0])] = self.taken[1].to_json()
        return dict(sorted(state.items(), key=lambda item: int(item[0])))

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


# The probe samples short continuations: the guard compares log-probs, not whole answers.
PROBE_TOKENS = 16
PROBE_STREAM = 9  # the probe's seed stream, apart from the step's chunks


@dataclass(frozen=True)
class AheadStart:
    """Where an off-policy or asynchronous run stands when its replica starts."""

    plan: Callable[[int], StepPlan]  # step -> what the replica samples for it (async: its probe)
    last_step: int  # nothing past it is sampled
    version: int  # the actor's version: completed training steps (the resumed step)
    buffer: dict[str, Any]  # RolloutService.state_dict() of the resumed checkpoint ({} when fresh)
    prompt_of: Callable[[int], Sequence[int]] | None = None  # async: group -> its prompt's token ids
    batch_groups: int = 1  # async: groups a step trains on (rl.rollout_batch)
    seed: int = 0  # async: the requests' seed stream


def timed_call(fn: Callable[[], Any]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def _fault_after_first(params: Iterator[tuple[str, torch.Tensor]], step: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters, with the kill point "weight_sync" armed after the first one is sent."""
    for index, item in enumerate(params):
        if index == 1:
            fault_point("rl", "weight_sync", step)
        yield item
