"""Reward model: a one-output sequence classifier trained with the Bradley-Terry loss."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from typing import Iterator

import torch
import torch.nn.functional as F
from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import LossParts, OptimSpec, TrainEngine
from rlflow.engine.data.batching import PromptResponseIds, batch_indices, encode_pair, pack_rows, rank_shard, right_pad
from rlflow.engine.config.schema import DataConfig
from rlflow.engine.config.stages import RewardModelConfig
from rlflow.engine.config.model import ModelConfig
from rlflow.engine.data.records import PreferencePair, load_preference_pairs, load_sft_examples
from rlflow.engine.models.loading import load_scalar_model, load_tokenizer, model_kwargs, sequence_scores
from rlflow.engine.errors import DataError
from rlflow.engine.stages.loop import StageStart, StepReport, run_stage_loop, training_stage
from rlflow.engine.models.lora import lora_metrics
from rlflow.engine.stages.context import StageContext, StageOutcome
from rlflow.engine.stages.lifecycle import finish, restore_training_state, save_checkpoint


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Per-pair loss -log sigmoid(r_chosen - r_rejected); inputs and output [B]."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


PairRow = tuple[PromptResponseIds, PromptResponseIds]  # (chosen, rejected) encoded


def _pair_rows(tokenizer, pairs: list[PreferencePair], max_tokens: int) -> list[PairRow]:
    return [
        (
            encode_pair(tokenizer, p.prompt, p.chosen, max_tokens),
            encode_pair(tokenizer, p.prompt, p.rejected, max_tokens),
        )
        for p in pairs
    ]


def _score_pairs(model, rows, pad_id: int, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [N] of the chosen and of the rejected answers of N pairs (padded, or packed in one row)."""
    sequences = [c for c, _ in rows] + [r for _, r in rows]
    if packed:
        batch = pack_rows(sequences)
        values = model(input_ids=batch.input_ids, attention_mask=None, position_ids=batch.position_ids)
        scores = values[0, batch.ends.to(values.device)]
    else:
        scores = sequence_scores(model, *right_pad(sequences, pad_id)[:2])
    return scores[: len(rows)], scores[len(rows) :]


def _rank_passes(rows: list, batch_size: int) -> Iterator[tuple[list, bool]]:
    """This rank's share of `rows` in chunks, padded with repeats to the same number of passes
    on every rank (ZeRO-3 gathers weights in each forward); yields (chunk, counts)."""
    mine = rank_shard(list(range(len(rows))), dist.rank(), dist.world_size())
    passes = dist.all_reduce_max(-(-len(mine) // batch_size))
    for i in range(passes):
        chunk = [rows[j] for j in mine[i * batch_size : (i + 1) * batch_size]]
        yield (chunk or [rows[0]]), bool(chunk)


@torch.no_grad()
def pairwise_accuracy(model, rows, pad_id: int, batch_size: int = 128) -> float:
    """Fraction of pairs whose chosen answer scores strictly higher (labels taken as given)."""
    model.eval()
    correct = 0
    for chunk, counts in _rank_passes(rows, batch_size):
        chosen, rejected = _score_pairs(model, chunk, pad_id)
        correct += int((chosen > rejected).sum()) if counts else 0
    model.train()
    return float(dist.all_reduce_sum(correct)) / max(1, len(rows))


@torch.no_grad()
def score_statistics(model, rows: list[PromptResponseIds], pad_id: int, batch_size: int = 128) -> tuple[float, float]:
    """Mean and std of raw scores on a fixed reference set; PPO normalises rewards with them so
    a retrained reward model does not shift the reward scale between rounds."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)  # sum, sum of squares
    for chunk, counts in _rank_passes(rows, batch_size):
        scores = sequence_scores(model, *right_pad(chunk, pad_id)[:2]).double().cpu()
        if counts:
            total += torch.stack([scores.sum(), (scores**2).sum()])
    model.train()
    total, n = dist.all_reduce_sum(total), len(rows)
    mean = float(total[0]) / n
    variance = max(float(total[1]) / n - mean**2, 0.0) * n / max(n - 1, 1)  # unbiased, like torch.std
    return mean, max(variance**0.5, 1e-6)


def rm_train_step(engine: TrainEngine, runtime, rows, pad_id: int, batch_size: int, step: int, ctx) -> dict:
    """One optimizer step of the Bradley-Terry loss averaged over every pair of global batch `step`."""
    indices = batch_indices(len(rows), batch_size, step, ctx.seed, ctx.round_index, 2)
    mine = [rows[j] for j in rank_shard(indices, dist.rank(), dist.world_size())]
    packed = runtime.cfg.packing
    if packed:  # a pair costs its two sequences' real tokens
        groups = runtime.packed_micro_batches([sum(len(x.prompt) + len(x.response) for x in pair) for pair in mine])
    else:  # a pair is two sequences padded to the longer one: twice that in the token budget
        groups = runtime.micro_batches(
            [2 * max(len(c.prompt) + len(c.response), len(r.prompt) + len(r.response)) for c, r in mine]
        )
    batches = [[mine[j] for j in g] for g in groups]

    def loss_fn(model, pairs) -> LossParts:
        chosen, rejected = _score_pairs(model, pairs, pad_id, packed)
        margin = (chosen - rejected).detach()
        return LossParts(
            bradley_terry_loss(chosen, rejected).sum(),
            float(len(pairs)),
            {
                "rm/train_accuracy": (float((margin > 0).sum()), len(pairs)),
                "rm/margin": (float(margin.sum()), len(pairs)),
            },
        )

    out = engine.train_step(batches, [float(len(b)) for b in batches], loss_fn)
    return {"rm/loss": out["loss"], "rm/grad_norm": out["grad_norm"], "rm/lr": out["lr"]} | {
        k: out[k] for k in ("rm/train_accuracy", "rm/margin", "skipped")
    }


def _load_pairs(urls: list[str], data: DataConfig) -> list[PreferencePair]:
    return [pair for url in urls for pair in load_preference_pairs(url, data.storage_options)]


def _stage_pairs(
    tokenizer, data: DataConfig, extra: tuple[str, ...], held_out: tuple[str, ...], max_tokens: int
) -> tuple[list[PairRow], dict[str, list[PairRow]]]:
    """(training pair rows, {accuracy metric: held-out pair rows}); tied held-out pairs carry no
    label and are dropped."""
    offline = [data.preferences] if data.preferences else []
    train_rows = _pair_rows(tokenizer, _load_pairs(offline + list(extra), data), max_tokens)
    if not train_rows:
        raise DataError(
            "the reward model has no preference pairs to train on: data.preferences is null and the online"
            " labels hold none (see label/pairs); set data.preferences or label.prompts_per_round higher"
        )
    urls = {
        "rm/accuracy": [data.preferences_eval] if data.preferences_eval else [],
        "rm/accuracy_online": list(held_out),
    }
    return train_rows, {
        key: _pair_rows(tokenizer, [p for p in _load_pairs(u, data) if p.chosen != p.rejected], max_tokens)
        for key, u in urls.items()
        if u
    }


@dataclass(frozen=True)
class RewardModelStageInputs:
    """What the reward-model stage needs, built once by the worker (engine/stages/worker.py)."""

    init_path: str  # the model to start from (the SFT policy, a local directory)
    model: ModelConfig  # model.*: loading options and LoRA
    rm: RewardModelConfig  # rm.*: optimizer, epochs, batch size, score-normalisation samples
    data: DataConfig  # data.preferences(_eval), data.sft (the normalisation set), chat template
    extra_preferences: tuple[str, ...] = ()  # online-labelled pairs (JSONL URIs) to train on too
    eval_preferences: tuple[str, ...] = ()  # held-out online-labelled pairs (label.eval_fraction)


@training_stage
def run_reward_model_stage(ctx: StageContext, inputs: RewardModelStageInputs, start: StageStart) -> StageOutcome:
    """Train on data.preferences (when set) plus `inputs.extra_preferences` (online-labelled JSONL
    URIs); measure accuracy on data.preferences_eval (clean gold labels: rm/accuracy) and on
    `inputs.eval_preferences` (held-out online labels of the policy's own answers: rm/accuracy_online)."""
    resume, changed, guard = start
    cfg, data = inputs.rm, inputs.data
    tokenizer = load_tokenizer(inputs.init_path, inputs.model.trust_remote_code, chat_template=data.chat_template)
    pad = tokenizer.pad_token_id

    def load():
        model = load_scalar_model(inputs.init_path, **model_kwargs(inputs.model))
        model.config.pad_token_id = pad
        return model

    held_out = inputs.eval_preferences
    train_rows, eval_sets = _stage_pairs(tokenizer, data, inputs.extra_preferences, held_out, cfg.max_seq_tokens)
    total_steps = cfg.epochs * math.ceil(len(train_rows) / cfg.batch_size)
    optim = OptimSpec(cfg.lr, cfg.weight_decay, cfg.warmup_steps, total_steps, cfg.max_grad_norm)
    engine = ctx.runtime.trainable("model", load, optim, lora=inputs.model.lora_for("rm"))
    if inputs.model.lora_for("rm"):
        ctx.sink.log_metrics(lora_metrics("reward_model", engine.model), 0)
    engine.train()
    steps = _RewardModelSteps(ctx, engine, tokenizer, cfg, data, (train_rows, eval_sets), total_steps)
    step = 0
    if resume is not None:
        restore_training_state(ctx, resume, {"model": engine})
        step = resume
    step = run_stage_loop(ctx, guard, steps, step).step
    metrics = steps.metrics
    if not set(eval_sets) <= set(metrics):  # resumed exactly at the last step, or stopped by a request
        metrics |= steps.accuracies()
    metrics["rm/score_mean"], metrics["rm/score_std"] = ctx.store.manifest(step)["meta"]["score_norm"]
    keep = ("rm/loss", "rm/accuracy", "rm/accuracy_online", "rm/score_mean", "rm/score_std")
    summary = {k: metrics[k] for k in keep if k in metrics} | {"rm/pairs": len(train_rows)}
    return finish(ctx, step, summary, resume, changed)


class _RewardModelSteps:
    """The reward model's part of the stage loop: epochs over the pairs, accuracies at the end,
    and at the last commit the score statistics RL normalises with."""

    def __init__(
        self, ctx: StageContext, engine: TrainEngine, tokenizer: Any, cfg: RewardModelConfig, data: DataConfig,
        rows: tuple[list, dict[str, list]], total_steps: int,
    ):
        self.ctx, self.engine, self.tokenizer, self.cfg, self.data = ctx, engine, tokenizer, cfg, data
        (train_rows, eval_sets), self.total_steps = rows, total_steps
        self.pad, self.engines = tokenizer.pad_token_id, (engine,)
        self.train_rows, self.eval_sets = train_rows, eval_sets
        self.metrics: dict[str, float] = {}

    def accuracies(self) -> dict[str, float]:
        return {k: pairwise_accuracy(self.engine.forward, rows, self.pad) for k, rows in self.eval_sets.items()}

    def more(self, step: int) -> bool:
        return step < self.total_steps

    def update(self, step: int) -> dict[str, float]:
        ctx = self.ctx
        return rm_train_step(self.engine, ctx.runtime, self.train_rows, self.pad, self.cfg.batch_size, step, ctx)

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        last = step == self.total_steps or stopping
        log = step % self.cfg.log_every == 0 or last
        if last:
            metrics |= self.accuracies()
        self.metrics = metrics
        return StepReport(metrics, last, log)

    def commit(self, step: int, whole: bool, last: bool) -> str:
        cfg, data, metrics = self.cfg, self.data, self.metrics
        if last:
            reference = [
                encode_pair(self.tokenizer, ex.prompt, ex.response, cfg.max_seq_tokens, ex.tools)
                for ex in load_sft_examples(data.sft, data.storage_options)[: cfg.norm_samples]
            ]
            scores = score_statistics(self.engine.forward, reference, self.pad)
            metrics["rm/score_mean"], metrics["rm/score_std"] = scores
        meta = {
            "score_norm": [metrics.get("rm/score_mean", 0.0), metrics.get("rm/score_std", 1.0)],
            "data_position": {"pairs_seen": step * cfg.batch_size},
        }
        return save_checkpoint(self.ctx, step, {"model": (self.engine, self.tokenizer)}, meta, whole)
