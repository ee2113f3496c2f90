"""Reward model: a one-output sequence classifier trained with the Bradley-Terry loss."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from rlflow.engine.batching import PromptResponseIds, batch_indices, encode_pair, right_pad
from rlflow.engine.config import DataConfig, ModelConfig, RewardModelConfig
from rlflow.engine.data import PreferencePair, load_preference_pairs, load_sft_examples
from rlflow.engine.models import load_scalar_model, load_tokenizer, sequence_scores
from rlflow.engine.stage import (
    StageContext,
    StageOutcome,
    completed_outcome,
    fault_point,
    finish,
    restore_training_state,
    resume_point,
    save_checkpoint,
)
from rlflow.engine.train_state import make_optimizer, make_schedule


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Per-pair loss -log sigmoid(r_chosen - r_rejected); inputs and output [B]."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def _pair_rows(
    tokenizer, pairs: list[PreferencePair], max_tokens: int
) -> list[tuple[PromptResponseIds, PromptResponseIds]]:
    return [
        (
            encode_pair(tokenizer, p.prompt, p.chosen, max_tokens),
            encode_pair(tokenizer, p.prompt, p.rejected, max_tokens),
        )
        for p in pairs
    ]


def _score_pairs(model, rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, attention, _ = right_pad([c for c, _ in rows] + [r for _, r in rows], pad_id)
    scores = sequence_scores(model, ids, attention)
    return scores[: len(rows)], scores[len(rows) :]


@torch.no_grad()
def pairwise_accuracy(model, rows, pad_id: int, batch_size: int = 128) -> float:
    """Fraction of pairs whose chosen answer scores strictly higher (labels taken as given)."""
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chosen, rejected = _score_pairs(model, rows[i : i + batch_size], pad_id)
        correct += int((chosen > rejected).sum())
    model.train()
    return correct / max(1, len(rows))


@torch.no_grad()
def score_statistics(model, rows: list[PromptResponseIds], pad_id: int, batch_size: int = 128) -> tuple[float, float]:
    """Mean and std of raw scores on a fixed reference set; PPO normalises rewards with them so
    a retrained reward model does not shift the reward scale between rounds."""
    model.eval()
    scores = torch.cat(
        [
            sequence_scores(model, *right_pad(rows[i : i + batch_size], pad_id)[:2])
            for i in range(0, len(rows), batch_size)
        ]
    )
    model.train()
    return float(scores.mean()), float(scores.std().clamp(min=1e-6))


def run_reward_model_stage(
    ctx: StageContext,
    init_path: str,
    model_cfg: ModelConfig,
    cfg: RewardModelConfig,
    data: DataConfig,
    extra_preferences: tuple[str, ...] = (),
) -> StageOutcome:
    """Train on data.preferences plus `extra_preferences` (online-labelled JSONL URIs); measure
    accuracy on data.preferences_eval (clean gold labels)."""
    if (done := completed_outcome(ctx)) is not None:
        return done
    resume, source = resume_point(ctx, init_path)
    tokenizer = load_tokenizer(source, model_cfg.trust_remote_code)
    model = load_scalar_model(source, model_cfg.dtype, model_cfg.trust_remote_code)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.train()
    pairs = list(load_preference_pairs(data.preferences, data.storage_options))
    for url in extra_preferences:
        pairs += load_preference_pairs(url, data.storage_options)
    train_rows = _pair_rows(tokenizer, pairs, cfg.max_seq_tokens)
    eval_pairs = [
        p for p in load_preference_pairs(data.preferences_eval, data.storage_options) if p.chosen != p.rejected
    ]
    eval_rows = _pair_rows(tokenizer, eval_pairs, cfg.max_seq_tokens)  # tied pairs carry no label: dropped
    total_steps = cfg.epochs * math.ceil(len(train_rows) / cfg.batch_size)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    schedule = make_schedule(optimizer, cfg.warmup_steps, total_steps)
    step = 0
    if resume is not None:
        restore_training_state(ctx, resume, {"rm": optimizer}, {"rm": schedule})
        step = resume
    started, metrics = time.monotonic(), {}
    pad = tokenizer.pad_token_id
    while step < total_steps:
        step += 1
        fault_point("rm", "step", step)
        rows = [
            train_rows[i] for i in batch_indices(len(train_rows), cfg.batch_size, step, ctx.seed, ctx.round_index, 2)
        ]
        chosen, rejected = _score_pairs(model, rows, pad)
        loss = bradley_terry_loss(chosen, rejected).mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        metrics = {
            "rm/loss": loss.item(),
            "rm/train_accuracy": float((chosen > rejected).float().mean().detach()),
            "rm/margin": float((chosen - rejected).detach().mean()),
            "rm/grad_norm": float(grad_norm),
            "timing_s/elapsed": time.monotonic() - started,
        }
        if step % cfg.log_every == 0 or step == total_steps:
            if step == total_steps:
                metrics["rm/accuracy"] = pairwise_accuracy(model, eval_rows, pad)
            ctx.sink.log_metrics(metrics, step)
        if step % ctx.every_steps == 0 or step == total_steps:
            if step == total_steps:
                reference = [
                    encode_pair(tokenizer, ex.prompt, ex.response, cfg.max_seq_tokens)
                    for ex in load_sft_examples(data.sft, data.storage_options)[: cfg.norm_samples]
                ]
                metrics["rm/score_mean"], metrics["rm/score_std"] = score_statistics(model, reference, pad)
            save_checkpoint(
                ctx,
                step,
                {"model": (model, tokenizer)},
                {"rm": optimizer},
                {"rm": schedule},
                {
                    "score_norm": [metrics.get("rm/score_mean", 0.0), metrics.get("rm/score_std", 1.0)],
                    "data_position": {"pairs_seen": step * cfg.batch_size},
                },
            )
    if "rm/accuracy" not in metrics:  # resumed exactly at the last step
        metrics["rm/accuracy"] = pairwise_accuracy(model, eval_rows, pad)
    metrics["rm/score_mean"], metrics["rm/score_std"] = ctx.store.manifest(step)["meta"]["score_norm"]
    keep = ("rm/loss", "rm/accuracy", "rm/score_mean", "rm/score_std")
    return finish(ctx, step, {k: metrics[k] for k in keep if k in metrics} | {"rm/pairs": len(train_rows)}, resume)
