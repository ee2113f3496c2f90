"""Supervised fine-tuning: causal-LM loss on response tokens, until held-out loss plateaus."""

from __future__ import annotations

from typing import Any, Literal

import torch
from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import LossParts, OptimSpec, Runtime, TrainEngine
from rlflow.engine.data.batching import (
    PackedRows,
    PromptResponseIds,
    batch_indices,
    encode_conversation,
    encode_pair,
    pack_rows,
    rank_shard,
    right_pad,
)
from rlflow.engine.config.base import SectionView
from rlflow.engine.config.schema import Config, DataConfig
from rlflow.engine.config.stages import SFTConfig
from rlflow.engine.data.records import SFTExample, load_sft_examples
from rlflow.engine.errors import DataError
from rlflow.engine.models.loading import load_policy, load_tokenizer, model_device, model_kwargs, position_ids_from_mask
from rlflow.engine.models.lm_head import next_token_logprobs
from rlflow.engine.stages.loop import StageStart, StepReport, run_stage_loop
from rlflow.engine.models.lora import lora_metrics
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.inputs import ModelInput, ModelLoading, StageInputs
from rlflow.engine.stages.lifecycle import finish, restore_training_state, save_checkpoint


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
    logprobs, _ = next_token_logprobs(model, ids, forward, 1)  # the LM head in chunks (engine/models/lm_head.py)
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


def encode_sft_example(tokenizer: Any, example: SFTExample, cfg: SFTConfig, encoders: dict) -> PromptResponseIds:
    """A row's ids and loss positions: a conversation's every assistant turn with
    sft.assistant_turns: all (encode_conversation), else the response after its prompt."""
    earlier = [t for t in example.prompt[1:] if t["role"] == "assistant"] if example.whole_conversation else []
    if cfg.assistant_turns == "last" or not earlier:
        return encode_pair(tokenizer, example.prompt, example.response, cfg.max_seq_tokens, example.tools)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"data.sft: a 'messages' row holds {len(earlier) + 1} assistant turns and the tokenizer has no chat "
            "template to mark where each ends: set data.chat_template: auto with a tokenizer that has one, or "
            "sft.assistant_turns: last (the earlier turns become context)")
    return encode_conversation(tokenizer, example, cfg.max_seq_tokens, encoders)


class SFTData(SectionView, source=DataConfig):
    """The data.* keys SFT reads."""

    sft: str
    sft_eval: str
    chat_template: Literal["auto", "none"]
    storage_options: dict[str, Any]


class SFTUpstream(Record):
    init: ModelInput  # the policy SFT starts from


class SFTInputs(StageInputs):
    """Everything the SFT stage reads."""

    upstream: SFTUpstream
    model: ModelLoading
    sft: SFTConfig  # optimizer, batch size, plateau criterion
    data: SFTData


def inputs_from(config: Config, upstream: SFTUpstream) -> SFTInputs:
    return SFTInputs(
        seed=config.run.seed,
        upstream=upstream,
        model=ModelLoading.for_stage(config.model, "sft"),
        sft=config.sft,
        data=SFTData.of(config.data),
    )


def run_sft_stage(ctx: StageContext, inputs: SFTInputs, start: StageStart) -> StageOutcome:
    """Train the policy from `inputs.upstream.init` on data.sft; stop when data.sft_eval loss plateaus.

    Plateau: `sft.patience` held-out evaluations in a row without a 1% relative improvement on
    the best so far, or `sft.max_steps` optimizer steps.
    """
    resume, changed, guard = start
    cfg, data = inputs.sft, inputs.data
    init = inputs.upstream.init.uri
    tokenizer = load_tokenizer(init, inputs.model.trust_remote_code, chat_template=data.chat_template)
    optim = OptimSpec(cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.max_steps, cfg.max_grad_norm)
    load = lambda: load_policy(init, **model_kwargs(inputs.model))  # noqa: E731
    engine = ctx.runtime.trainable("model", load, optim, lora=inputs.model.lora)
    if inputs.model.lora:
        ctx.sink.log_metrics(lora_metrics("policy", engine.model), 0)
    engine.train()
    encoders: dict = {}  # one ConversationEncoder per tool set
    encode = lambda ex: encode_sft_example(tokenizer, ex, cfg, encoders)  # noqa: E731
    train_rows = [encode(ex) for ex in load_sft_examples(data.sft, data.storage_options)]
    eval_rows = [encode(ex) for ex in load_sft_examples(data.sft_eval, data.storage_options)]
    step, state = 0, {"best_eval_loss": float("inf"), "bad_evals": 0}
    if resume is not None:
        step, state = resume, restore_training_state(ctx, resume, {"model": engine})["sft_state"]
    steps = _SFTSteps(ctx, engine, tokenizer, cfg, (train_rows, eval_rows), state)
    step = run_stage_loop(ctx, guard, steps, step).step
    final_metrics = {"sft/eval_loss": steps.state["best_eval_loss"], "sft/steps": step} | guard.early_stop_metrics()
    if "sft/loss" in steps.metrics:  # absent when resumed exactly at the last step
        final_metrics["sft/loss"] = steps.metrics["sft/loss"]
    return finish(ctx, step, final_metrics, resume, changed)


class _SFTSteps:
    """SFT's part of the stage loop: a step on the next batch, held-out loss every eval_every, the
    plateau criterion."""

    def __init__(self, ctx: StageContext, engine: TrainEngine, tokenizer: Any, cfg: SFTConfig, rows, state):
        self.ctx, self.engine, self.tokenizer, self.cfg = ctx, engine, tokenizer, cfg
        self.pad_id = tokenizer.pad_token_id
        (self.train_rows, self.eval_rows), self.engines = rows, (engine,)
        self.state = state  # the plateau criterion's: best held-out loss, evaluations without improvement
        self.metrics: dict[str, float] = {}

    def more(self, step: int) -> bool:
        return step < self.cfg.max_steps and self.state["bad_evals"] < self.cfg.patience

    def update(self, step: int) -> dict[str, float]:
        ctx = self.ctx
        return sft_train_step(self.engine, ctx.runtime, self.train_rows, self.pad_id, self.cfg.batch_size, step, ctx)

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        cfg, state = self.cfg, self.state
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            metrics["sft/eval_loss"] = heldout_loss(self.engine.forward, self.eval_rows, self.pad_id)
            improved = metrics["sft/eval_loss"] < state["best_eval_loss"] * 0.99
            self.state = {
                "best_eval_loss": min(state["best_eval_loss"], metrics["sft/eval_loss"]),
                "bad_evals": 0 if improved else state["bad_evals"] + 1,
            }
        self.metrics = metrics
        last = step >= cfg.max_steps or self.state["bad_evals"] >= cfg.patience or stopping
        return StepReport(metrics, last, log=step % cfg.log_every == 0 or "sft/eval_loss" in metrics)

    def commit(self, step: int, whole: bool, last: bool) -> str:
        meta = {"sft_state": self.state, "data_position": {"examples_seen": step * self.cfg.batch_size}}
        return save_checkpoint(self.ctx, step, {"model": (self.engine, self.tokenizer)}, meta, whole)


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
