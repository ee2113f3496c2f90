"""Supervised fine-tuning: causal-LM loss on response tokens, until held-out loss plateaus."""

from __future__ import annotations

import time

import torch
from rlflow.engine import dist
from rlflow.engine.backend import LossParts, OptimSpec, Runtime, TrainEngine
from rlflow.engine.batching import (
    PackedRows,
    PromptResponseIds,
    batch_indices,
    encode_pair,
    pack_rows,
    rank_shard,
    right_pad,
)
from rlflow.engine.config import DataConfig, ModelConfig, SFTConfig
from rlflow.engine.data import load_sft_examples
from rlflow.engine.models import load_policy, load_tokenizer, model_device, model_kwargs, position_ids_from_mask
from rlflow.engine.faults import fault_point
from rlflow.engine.lm_head import next_token_logprobs
from rlflow.engine.stage_guard import StageGuard
from rlflow.engine.lora import lora_metrics
from rlflow.engine.stage import (
    StageContext,
    StageOutcome,
    completed_outcome,
    finish,
    restore_training_state,
    save_checkpoint,
    should_consolidate,
    start_stage,
)


def response_token_loss(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention: torch.Tensor | None,
    response_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL over response tokens, and their count.

    ids/attention/response_mask: [B, T]; packed rows: attention None and position_ids [1, T]
    restarting per sequence (a boundary's target is the next prompt's first token, masked out).
    Returns (sum of NLL in nats, number of tokens); the caller divides by the token count of the
    whole accumulation group.
    """
    if attention is not None:
        position_ids = position_ids_from_mask(attention)
    device = model_device(model)
    ids, response_mask, position_ids = ids.to(device), response_mask.to(device), position_ids.to(device)
    attention = attention.to(device) if attention is not None else None
    forward = {"attention_mask": attention, "position_ids": position_ids, "use_cache": False}
    logprobs, _ = next_token_logprobs(model, ids, forward, 1)  # the LM head in chunks (engine/lm_head.py)
    mask = response_mask[:, 1:]
    return -(logprobs * mask).sum(), mask.sum()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: list[PromptResponseIds], pad_id: int, batch_size: int = 64) -> float:
    """Mean NLL per response token (nats) over `rows`, each rank scoring its share.

    Every rank runs the same number of passes (ZeRO-3 gathers weights in each forward)."""
    model.eval()
    mine = rank_shard(list(range(len(rows))), dist.rank(), dist.world_size())
    passes = dist.all_reduce_max(-(-len(mine) // batch_size))
    total, count = 0.0, 0.0
    for i in range(passes):
        chunk = [rows[j] for j in mine[i * batch_size : (i + 1) * batch_size]] or [rows[0]]
        loss_sum, n = response_token_loss(model, *right_pad(chunk, pad_id))
        if i * batch_size < len(mine):
            total, count = total + loss_sum.item(), count + n.item()
    model.train()
    total_count = dist.all_reduce_sum(torch.tensor([total, count]))
    return float(total_count[0]) / max(float(total_count[1]), 1.0)


def run_sft_stage(
    ctx: StageContext, init_path: str, model_cfg: ModelConfig, cfg: SFTConfig, data: DataConfig
) -> StageOutcome:
    """Train the policy from `init_path` on data.sft; stop when data.sft_eval loss plateaus.

    Plateau: `cfg.patience` held-out evaluations in a row without a 1% relative improvement on
    the best so far, or `cfg.max_steps` optimizer steps.
    """
    if (done := completed_outcome(ctx)) is not None:
        return done
    resume, changed = start_stage(ctx)
    guard = StageGuard(ctx, resume)
    tokenizer = load_tokenizer(init_path, model_cfg.trust_remote_code, chat_template=data.chat_template)
    optim = OptimSpec(cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.max_steps, cfg.max_grad_norm)
    load = lambda: load_policy(init_path, **model_kwargs(model_cfg))  # noqa: E731
    engine = ctx.runtime.trainable("model", load, optim, lora=model_cfg.lora_for("sft"))
    if model_cfg.lora_for("sft"):
        ctx.sink.log_metrics(lora_metrics("policy", engine.model), 0)
    engine.train()
    encode = lambda ex: encode_pair(tokenizer, ex.prompt, ex.response, cfg.max_seq_tokens)
    train_rows = [encode(ex) for ex in load_sft_examples(data.sft, data.storage_options)]
    eval_rows = [encode(ex) for ex in load_sft_examples(data.sft_eval, data.storage_options)]
    state = {"best_eval_loss": float("inf"), "bad_evals": 0}
    step = 0
    if resume is not None:
        step, state = resume, restore_training_state(ctx, resume, {"model": engine})["sft_state"]
    started, metrics = time.monotonic(), {}
    with guard:
        while step < cfg.max_steps and state["bad_evals"] < cfg.patience and not guard.stop_requested:
            step += 1
            guard.begin(step)
            engine.poison_loss = guard.poisoned(step)
            metrics = sft_train_step(engine, ctx.runtime, train_rows, tokenizer.pad_token_id, cfg.batch_size, step, ctx)
            metrics |= guard.record_update(bool(metrics.pop("skipped")), step)
            fault_point("sft", "update", step)
            if step % cfg.eval_every == 0 or step == cfg.max_steps:
                metrics["sft/eval_loss"] = heldout_loss(engine.forward, eval_rows, tokenizer.pad_token_id)
                improved = metrics["sft/eval_loss"] < state["best_eval_loss"] * 0.99
                state = {
                    "best_eval_loss": min(state["best_eval_loss"], metrics["sft/eval_loss"]),
                    "bad_evals": 0 if improved else state["bad_evals"] + 1,
                }
            metrics["timing_s/elapsed"] = time.monotonic() - started
            guard.end(step)
            if step % cfg.log_every == 0 or "sft/eval_loss" in metrics:
                ctx.sink.log_metrics(metrics, step)
            done_now = step >= cfg.max_steps or state["bad_evals"] >= cfg.patience or guard.stop_requested
            if guard.checkpoint_due(step, done_now):
                url = save_checkpoint(
                    ctx,
                    step,
                    {"model": (engine, tokenizer)},
                    {"sft_state": state, "data_position": {"examples_seen": step * cfg.batch_size}},
                    should_consolidate(ctx, step, done_now),
                )
                guard.after_checkpoint(step, url)
    final_metrics = {"sft/eval_loss": state["best_eval_loss"], "sft/steps": step} | guard.early_stop_metrics()
    if "sft/loss" in metrics:  # absent when resumed exactly at the last step
        final_metrics["sft/loss"] = metrics["sft/loss"]
    return finish(ctx, step, final_metrics, resume, changed)


def sft_train_step(
    engine: TrainEngine, runtime: Runtime, rows, pad_id: int, batch_size: int, step: int, ctx: StageContext
) -> dict[str, float]:
    """One optimizer step on global batch `step`; this rank takes its share, cut into micro-batches.

    The loss is the mean NLL over every response token of the global batch."""
    indices = batch_indices(len(rows), batch_size, step, ctx.seed, ctx.round_index, 1)
    mine = [rows[j] for j in rank_shard(indices, dist.rank(), dist.world_size())]
    lengths = [len(r.prompt) + len(r.response) for r in mine]
    if runtime.cfg.packing:
        batches = [pack_rows([mine[j] for j in g]) for g in runtime.packed_micro_batches(lengths)]
        units = [float(b.response_mask[:, 1:].sum()) for b in batches]
    else:
        batches = [right_pad([mine[j] for j in g], pad_id) for g in runtime.micro_batches(lengths)]
        units = [float(b[2][:, 1:].sum()) for b in batches]

    def loss_fn(model, batch) -> LossParts:
        if isinstance(batch, PackedRows):
            loss_sum, count = response_token_loss(model, batch.input_ids, None, batch.response_mask, batch.position_ids)
        else:
            loss_sum, count = response_token_loss(model, *batch)
        return LossParts(loss_sum, float(count))

    out = engine.train_step(batches, units, loss_fn)
    names = {"sft/loss": "loss", "sft/grad_norm": "grad_norm", "sft/lr": "lr", "sft/tokens": "units"}
    return {name: out[key] for name, key in names.items()} | {"skipped": out["skipped"]}
