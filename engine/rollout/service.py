"""PPO's rollouts from a separate worker process (`rollout.mode: server`), with the sync guard.

Rank 0 owns the worker. It samples every chunk of a step (chunk c with the same seed colocated
sampling would use), and each rank takes its chunks' token ids. After every optimizer step the
actor's weights go to the worker in buckets; the trainer then compares weight fingerprints and,
on the next batch, the log-probs the worker reported for its samples against the trainer's own
(computed anyway as PPO's old log-probs): a skipped or partial sync stops the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import TrainEngine
from rlflow.engine.config.execution import RolloutConfig
from rlflow.engine.rollout.generate import RolloutBatch
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.rollout.weight_sync import check_weight_sync, weights_fingerprint


@dataclass
class RolloutService:
    cfg: RolloutConfig
    client: Any = None  # RolloutClient on rank 0, None elsewhere
    tokenizer: Any = None
    trainer_fingerprint: str | None = None  # at the last sync (rank 0)
    worker_fingerprint: str | None = None

    @classmethod
    def start(
        cls,
        cfg: RolloutConfig,
        model_dir: str,
        tokenizer: Any,
        actor: TrainEngine,
        log_path: str | None,
        cuda_visible_devices: str | None = None,
    ):
        """Start the worker on rank 0 (on `cuda_visible_devices`: placement.rollout) and send it
        the actor's current weights (a resumed actor differs from `model_dir`). A collective
        under ZeRO-3."""
        client = None
        if dist.is_main():
            from rlflow.engine.rollout.server import RolloutClient

            client = RolloutClient.start(
                cfg.server_backend,
                model_dir,
                python=cfg.vllm_python if cfg.server_backend == "vllm" else None,
                startup_timeout_s=cfg.startup_timeout_s,
                response_timeout_s=cfg.response_timeout_s,
                tokenizer=tokenizer,
                log_path=log_path,
                cuda_visible_devices=cuda_visible_devices,
            )
        service = cls(cfg, client, tokenizer)
        service.sync(actor)
        return service

    def sample_chunks(
        self, chunks: Sequence[tuple[int, Sequence[Sequence[int]], int]], params: SamplingParams
    ) -> dict[int, RolloutBatch]:
        """chunks: (chunk index, prompts, seed) of the whole step, the same list on every rank.
        Returns this rank's chunks (index c with c % world == rank) as RolloutBatches."""
        from rlflow.engine.rollout.served import build_rollout_batch
        from rlflow.engine.rollout.server import Generation

        sampled: list[list[list[int]]] = []
        logprobs: list[list[list[float]]] = []
        if self.client is not None:
            for _, prompts, seed in chunks:
                generation = self.client.generate(prompts, params, seed)
                sampled.append(generation.response_ids)
                logprobs.append(generation.logprobs)
        if dist.world_size() > 1:  # rank 0 hands every rank the token ids of all chunks
            sampled, logprobs = dist.all_gather_json([sampled, logprobs] if dist.is_main() else None)[0]
        mine: dict[int, RolloutBatch] = {}
        for (c, prompts, _), ids, lps in zip(chunks, sampled, logprobs):
            if c % dist.world_size() != dist.rank():
                continue
            mine[c] = build_rollout_batch(self.tokenizer, prompts, Generation(ids, lps), params.max_new_tokens)
        return mine

    def check(self, batch: RolloutBatch, trainer_logprobs: torch.Tensor) -> tuple[float, float, float]:
        """Guard one chunk: the trainer's log-probs [b, R] of the worker's samples (PPO's old
        log-probs) against the worker's own (batch.sampled_logprobs); fingerprints too (rank 0,
        once after each sync). Raises WeightSyncError; returns (sum of |diff| in nats, tokens, max |diff|)."""
        compare_fingerprints = self.cfg.check_fingerprint and self.trainer_fingerprint is not None
        result = check_weight_sync(
            self.trainer_fingerprint,
            self.worker_fingerprint,
            trainer_logprobs,
            batch.sampled_logprobs,
            batch.response_mask,
            self.cfg.max_logprob_diff,
            compare_fingerprints,
        )
        self.trainer_fingerprint = self.worker_fingerprint = None  # compared: until the next sync
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

    def sync(self, actor: TrainEngine) -> dict[str, float]:
        """Send the actor's weights to the worker; record both fingerprints. A collective under ZeRO-3."""
        started = time.monotonic()
        params = actor.named_full_parameters()
        if self.client is None:
            for _ in params:  # ZeRO-3: every rank takes part in each parameter's gather
                pass
            if self.cfg.check_fingerprint:
                for _ in actor.named_full_parameters():
                    pass
            return {}
        stats = self.client.update_weights(params, self.cfg.bucket_mb)
        metrics = {"timing_s/update_weights": time.monotonic() - started, "rollout/sync_gb_per_s": stats.gb_per_s}
        if self.cfg.check_fingerprint:
            self.trainer_fingerprint = weights_fingerprint(actor.named_full_parameters(), round_to=self.client.dtype)
            self.worker_fingerprint = self.client.fingerprint()
        return metrics

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
