"""Supervised fine-tuning: causal-LM loss on response tokens, until held-out loss plateaus."""

from __future__ import annotations

import time

import torch

from rlflow.engine.batching import PromptResponseIds, batch_indices, encode_pair, right_pad
from rlflow.engine.config import DataConfig, ModelConfig, SFTConfig
from rlflow.engine.data import load_sft_examples
from rlflow.engine.models import load_policy, load_tokenizer, position_ids_from_mask
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


def response_token_loss(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL over response tokens, and their count.

    ids/attention/response_mask: [B, T]. Returns (sum of NLL in nats, number of tokens); the
    caller divides by the token count of the whole accumulation group.
    """
    logits = model(
        input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention), use_cache=False
    ).logits
    targets, mask = ids[:, 1:], response_mask[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum(), mask.sum()


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: list[PromptResponseIds], pad_id: int, batch_size: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0.0
    for i in range(0, len(rows), batch_size):
        loss_sum, n = response_token_loss(model, *right_pad(rows[i : i + batch_size], pad_id))
        total, count = total + loss_sum.item(), count + n.item()
    model.train()
    return total / max(count, 1.0)


def run_sft_stage(
    ctx: StageContext, init_path: str, model_cfg: ModelConfig, cfg: SFTConfig, data: DataConfig
) -> StageOutcome:
    """Train the policy from `init_path` on data.sft; stop when data.sft_eval loss plateaus.

    Plateau: `cfg.patience` held-out evaluations in a row without a 1% relative improvement on
    the best so far, or `cfg.max_steps` optimizer steps.
    """
    if (done := completed_outcome(ctx)) is not None:
        return done
    resume, source = resume_point(ctx, init_path)
    tokenizer = load_tokenizer(source, model_cfg.trust_remote_code)
    model = load_policy(source, model_cfg.dtype, model_cfg.trust_remote_code)
    model.train()
    encode = lambda ex: encode_pair(tokenizer, ex.prompt, ex.response, cfg.max_seq_tokens)  # noqa: E731
    train_rows = [encode(ex) for ex in load_sft_examples(data.sft, data.storage_options)]
    eval_rows = [encode(ex) for ex in load_sft_examples(data.sft_eval, data.storage_options)]
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay)
    schedule = make_schedule(optimizer, cfg.warmup_steps, cfg.max_steps)
    state = {"best_eval_loss": float("inf"), "bad_evals": 0}
    step = 0
    if resume is not None:
        meta = restore_training_state(ctx, resume, {"policy": optimizer}, {"policy": schedule})
        step, state = resume, meta["sft_state"]
    started, metrics = time.monotonic(), {}
    while step < cfg.max_steps and state["bad_evals"] < cfg.patience:
        step += 1
        fault_point("sft", "step", step)
        metrics = _train_step(model, optimizer, schedule, train_rows, tokenizer.pad_token_id, cfg, step, ctx)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            metrics["sft/eval_loss"] = heldout_loss(model, eval_rows, tokenizer.pad_token_id)
            improved = metrics["sft/eval_loss"] < state["best_eval_loss"] * 0.99
            state = {
                "best_eval_loss": min(state["best_eval_loss"], metrics["sft/eval_loss"]),
                "bad_evals": 0 if improved else state["bad_evals"] + 1,
            }
        metrics["timing_s/elapsed"] = time.monotonic() - started
        if step % cfg.log_every == 0 or "sft/eval_loss" in metrics:
            ctx.sink.log_metrics(metrics, step)
        done_now = step >= cfg.max_steps or state["bad_evals"] >= cfg.patience
        if step % ctx.every_steps == 0 or done_now:
            save_checkpoint(
                ctx,
                step,
                {"model": (model, tokenizer)},
                {"policy": optimizer},
                {"policy": schedule},
                {"sft_state": state, "data_position": {"examples_seen": step * cfg.batch_size * cfg.grad_accum}},
            )
    final_metrics = {"sft/eval_loss": state["best_eval_loss"], "sft/steps": step}
    if "sft/loss" in metrics:  # absent when resumed exactly at the last step
        final_metrics["sft/loss"] = metrics["sft/loss"]
    return finish(ctx, step, final_metrics, resume)


def _train_step(
    model, optimizer, schedule, rows, pad_id: int, cfg: SFTConfig, step: int, ctx: StageContext
) -> dict[str, float]:
    indices = batch_indices(len(rows), cfg.batch_size * cfg.grad_accum, step, ctx.seed, ctx.round_index, 1)
    groups = [indices[i :: cfg.grad_accum] for i in range(cfg.grad_accum)]
    batches = [right_pad([rows[j] for j in g], pad_id) for g in groups]
    n_tokens = sum(b[2][:, 1:].sum() for b in batches)  # global count: micro-batches of unequal length
    total = 0.0
    for ids, attention, response_mask in batches:
        loss_sum, _ = response_token_loss(model, ids, attention, response_mask)
        (loss_sum / n_tokens).backward()
        total += loss_sum.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "sft/loss": total / float(n_tokens),
        "sft/grad_norm": float(grad_norm),
        "sft/lr": schedule.get_last_lr()[0],
        "sft/tokens": float(n_tokens),
    }
