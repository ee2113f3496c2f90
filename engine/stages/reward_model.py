"""Reward model: a sequence classifier trained with the Bradley-Terry loss: one score head, or
an ensemble of rm.ensemble heads on one backbone, each on its own bootstrap resample of the pairs."""

from __future__ import annotations

import math
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import LossParts, OptimSpec, TrainEngine
from rlflow.engine.data.batching import (
    PromptResponseIds,
    batch_indices,
    bootstrap_weights,
    encode_pair,
    pack_rows,
    rank_shard,
    right_pad,
)
from rlflow.engine.config.base import SectionView
from rlflow.engine.config.schema import Config, DataConfig
from rlflow.engine.config.stages import RewardModelConfig
from rlflow.engine.data.records import PreferencePair, load_preference_pairs, load_sft_examples
from rlflow.engine.models.loading import (
    head_columns,
    load_scalar_model,
    load_tokenizer,
    model_kwargs,
    sequence_scores,
)
from rlflow.engine.rewards.model_scores import ScoreNorm, ensemble_mean_std
from rlflow.engine.errors import DataError
from rlflow.engine.stages.loop import StageStart, StepReport, run_stage_loop
from rlflow.engine.models.lora import lora_metrics
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.inputs import LabelsInput, ModelInput, ModelLoading, StageInputs
from rlflow.engine.stages.lifecycle import finish, restore_training_state, save_checkpoint


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Per-pair loss -log sigmoid(r_chosen - r_rejected); inputs and output [B] (or [B, H]: per head)."""
    return -F.logsigmoid(chosen_scores - rejected_scores)


def accuracy_by_spread(margins: torch.Tensor, spread: torch.Tensor) -> tuple[float, float]:
    """Pair accuracy (margin > 0) of the half of the pairs with the lowest ensemble spread, and of
    the half with the highest; margins, spread [N]. An informative spread makes the first higher.
    With N odd the median pair is in neither half."""
    order = torch.argsort(spread, stable=True)
    half = len(order) // 2
    correct = (margins > 0).float()
    return float(correct[order[:half]].mean()), float(correct[order[len(order) - half :]].mean())


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
    """Scores [N, H] of the chosen and of the rejected answers of N pairs by the H heads (padded, or
    packed in one row)."""
    sequences = [c for c, _ in rows] + [r for _, r in rows]
    if packed:
        batch = pack_rows(sequences)
        values = model(input_ids=batch.input_ids, attention_mask=None, position_ids=batch.position_ids)
        scores = values[0, batch.ends.to(values.device)]
    else:
        scores = sequence_scores(model, *right_pad(sequences, pad_id)[:2])
    scores = head_columns(scores)
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
def pair_margins(model, rows, pad_id: int, norm: ScoreNorm, batch_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] margins (chosen minus rejected, the ensemble's mean of normalised heads) and [N] spread
    (the heads' std, averaged over the pair's two answers; 0 for one head) of every pair, on every rank."""
    model.eval()
    mean, std = (torch.as_tensor(x, dtype=torch.float32) for x in norm)
    local = []
    for chunk, counts in _rank_passes(rows, batch_size):
        chosen, rejected = ((s.float().cpu() - mean) / std for s in _score_pairs(model, chunk, pad_id))
        (c_mean, c_std), (r_mean, r_std) = ensemble_mean_std(chosen), ensemble_mean_std(rejected)
        local += list(zip((c_mean - r_mean).tolist(), ((c_std + r_std) / 2).tolist())) if counts else []
    model.train()
    pairs = [p for part in dist.all_gather_json(local) for p in part] if dist.is_distributed() else local
    values = torch.tensor(pairs, dtype=torch.float32).reshape(-1, 2)
    return values[:, 0], values[:, 1]


def held_out_accuracies(model, eval_sets: dict[str, list], pad_id: int, norm: ScoreNorm) -> dict[str, float]:
    """<set> (e.g. rm/accuracy): the fraction of held-out pairs whose chosen answer scores strictly
    higher; for an ensemble also <set>_std_bottom_half and <set>_std_top_half, the same over the
    half of the pairs the heads agree on most and the half they agree on least."""
    metrics = {}
    for key, rows in eval_sets.items():
        margins, spread = pair_margins(model, rows, pad_id, norm)
        metrics[key] = float((margins > 0).float().mean()) if len(margins) else 0.0
        if spread.any() and len(margins) >= 2:
            metrics[f"{key}_std_bottom_half"], metrics[f"{key}_std_top_half"] = accuracy_by_spread(margins, spread)
    return metrics


@torch.no_grad()
def score_statistics(model, rows: list[PromptResponseIds], pad_id: int, batch_size: int = 128) -> ScoreNorm:
    """Mean and std of raw scores on a fixed reference set, per head for an ensemble; RL
    normalises rewards with them so a retrained reward model does not shift the reward scale
    between rounds."""
    model.eval()
    parts = []  # [2, H] per pass: sum, sum of squares (0 for a pass that only keeps the ranks in step)
    for chunk, counts in _rank_passes(rows, batch_size):
        scores = head_columns(sequence_scores(model, *right_pad(chunk, pad_id)[:2]).double().cpu())
        parts.append(torch.stack([scores.sum(0), (scores**2).sum(0)]) * float(counts))
    model.train()
    total, n = dist.all_reduce_sum(torch.stack(parts).sum(0)), len(rows)
    mean = total[0] / n
    variance = (total[1] / n - mean**2).clamp(min=0.0) * n / max(n - 1, 1)  # unbiased, like torch.std
    std = variance.sqrt().clamp(min=1e-6)
    if len(mean) == 1:
        return float(mean[0]), float(std[0])
    return tuple(mean.tolist()), tuple(std.tolist())


def score_norm_metrics(norm: ScoreNorm) -> dict[str, float]:
    """rm/score_mean and rm/score_std (an ensemble's: the heads' averages, and rm/heads plus
    rm/head_<h>/score_mean and _std for each head), read back by score_norm_from_metrics."""
    mean, std = norm
    if isinstance(mean, float | int):
        return {"rm/score_mean": float(mean), "rm/score_std": float(std)}
    heads = {f"rm/head_{h}/score_{k}": float(v[h]) for h in range(len(mean)) for k, v in (("mean", mean), ("std", std))}
    return {"rm/score_mean": sum(mean) / len(mean), "rm/score_std": sum(std) / len(std), "rm/heads": len(mean)} | heads


def score_norm_from_metrics(metrics: dict[str, float]) -> ScoreNorm:
    """The reward model's score normalisation from its stage's metrics (score_norm_metrics)."""
    heads = int(metrics.get("rm/heads", 1))
    if heads == 1:
        return metrics["rm/score_mean"], metrics["rm/score_std"]
    return (
        tuple(metrics[f"rm/head_{h}/score_mean"] for h in range(heads)),
        tuple(metrics[f"rm/head_{h}/score_std"] for h in range(heads)),
    )


def rm_train_step(
    engine: TrainEngine, runtime, rows, weights: torch.Tensor, pad_id: int, batch_size: int, step: int, ctx
) -> dict:
    """One optimizer step of the Bradley-Terry loss over every pair of global batch `step`, head h's
    loss of pair i weighted by weights[i, h] (its bootstrap count; [N, H]) and averaged over heads."""
    indices = batch_indices(len(rows), batch_size, step, ctx.seed, ctx.round_index, 2)
    ids = rank_shard(indices, dist.rank(), dist.world_size())
    mine = [rows[j] for j in ids]
    packed = runtime.cfg.packing
    if packed:  # a pair costs its two sequences' real tokens
        groups = runtime.packed_micro_batches([sum(len(x.prompt) + len(x.response) for x in pair) for pair in mine])
    else:  # a pair is two sequences padded to the longer one: twice that in the token budget
        groups = runtime.micro_batches(
            [2 * max(len(c.prompt) + len(c.response), len(r.prompt) + len(r.response)) for c, r in mine]
        )
    batches = [([mine[j] for j in g], weights[[ids[j] for j in g]]) for g in groups]

    def loss_fn(model, micro) -> LossParts:
        pairs, pair_weights = micro
        chosen, rejected = _score_pairs(model, pairs, pad_id, packed)
        losses = bradley_terry_loss(chosen, rejected) * pair_weights.to(chosen.device)  # [b, H]
        margin = (chosen - rejected).detach().mean(1)
        return LossParts(
            losses.sum() / losses.shape[1],
            float(len(pairs)),
            {
                "rm/train_accuracy": (float((margin > 0).sum()), len(pairs)),
                "rm/margin": (float(margin.sum()), len(pairs)),
            },
        )

    out = engine.train_step(batches, [float(len(b)) for b, _ in batches], loss_fn)
    return {"rm/loss": out["loss"], "rm/grad_norm": out["grad_norm"], "rm/lr": out["lr"]} | {
        k: out[k] for k in ("rm/train_accuracy", "rm/margin", "skipped")
    }


def _load_pairs(urls: list[str], data: RewardModelData) -> list[PreferencePair]:
    return [pair for url in urls for pair in load_preference_pairs(url, data.storage_options)]


def _stage_pairs(
    tokenizer, data: RewardModelData, labels: tuple[LabelsInput, ...], max_tokens: int
) -> tuple[list[PairRow], dict[str, list[PairRow]]]:
    """(training pair rows, {accuracy metric: held-out pair rows}); tied held-out pairs carry no
    label and are dropped."""
    offline = [data.preferences] if data.preferences else []
    extra = [labelled.train for labelled in labels if labelled.train is not None]
    train_rows = _pair_rows(tokenizer, _load_pairs(offline + extra, data), max_tokens)
    if not train_rows:
        raise DataError(
            "the reward model has no preference pairs to train on: data.preferences is null and the online"
            " labels hold none (see label/pairs); set data.preferences or label.prompts_per_round higher"
        )
    urls = {
        "rm/accuracy": [data.preferences_eval] if data.preferences_eval else [],
        "rm/accuracy_online": [labelled.held_out for labelled in labels if labelled.held_out is not None],
    }
    return train_rows, {
        key: _pair_rows(tokenizer, [p for p in _load_pairs(u, data) if p.chosen != p.rejected], max_tokens)
        for key, u in urls.items()
        if u
    }


class RewardModelData(SectionView, source=DataConfig):
    """The data.* keys the reward model reads (data.sft: its score-normalisation set)."""

    preferences: str | None
    preferences_eval: str | None
    sft: str
    chat_template: Literal["auto", "none"]
    storage_options: dict[str, Any]


class RewardModelUpstream(Record):
    init: ModelInput  # the model the reward model starts from (rm.init)
    labels: tuple[LabelsInput, ...] = ()  # every online label stage so far, and the human label files


class RewardModelInputs(StageInputs):
    """Everything the reward-model stage reads."""

    upstream: RewardModelUpstream
    model: ModelLoading
    rm: RewardModelConfig  # optimizer, epochs, batch size, ensemble, score-normalisation samples
    data: RewardModelData


def inputs_from(config: Config, upstream: RewardModelUpstream) -> RewardModelInputs:
    return RewardModelInputs(
        seed=config.run.seed,
        upstream=upstream,
        model=ModelLoading.for_stage(config.model, "rm"),
        rm=config.rm,
        data=RewardModelData.of(config.data),
    )


def run_reward_model_stage(ctx: StageContext, inputs: RewardModelInputs, start: StageStart) -> StageOutcome:
    """Train on data.preferences (when set) plus the upstream labels' training pairs; measure accuracy
    on data.preferences_eval (clean gold labels: rm/accuracy) and on the labels' held-out pairs (the
    policy's own answers: rm/accuracy_online)."""
    resume, changed, guard = start
    cfg, data = inputs.rm, inputs.data
    init = inputs.upstream.init.uri
    tokenizer = load_tokenizer(init, inputs.model.trust_remote_code, chat_template=data.chat_template)
    pad = tokenizer.pad_token_id

    def load():
        model = load_scalar_model(init, heads=cfg.ensemble, **model_kwargs(inputs.model))
        model.config.pad_token_id = pad
        return model

    train_rows, eval_sets = _stage_pairs(tokenizer, data, inputs.upstream.labels, cfg.max_seq_tokens)
    total_steps = cfg.epochs * math.ceil(len(train_rows) / cfg.batch_size)
    optim = OptimSpec(cfg.lr, cfg.weight_decay, cfg.warmup_steps, total_steps, cfg.max_grad_norm)
    engine = ctx.runtime.trainable("model", load, optim, lora=inputs.model.lora)
    if inputs.model.lora:
        ctx.sink.log_metrics(lora_metrics("reward_model", engine.model), 0)
    engine.train()
    weights = bootstrap_weights(len(train_rows), cfg.ensemble, ctx.seed, ctx.round_index, 3)
    steps = _RewardModelSteps(ctx, engine, tokenizer, cfg, data, (train_rows, weights, eval_sets), total_steps)
    step = 0
    if resume is not None:
        restore_training_state(ctx, resume, {"model": engine})
        step = resume
    step = run_stage_loop(ctx, guard, steps, step).step
    metrics = steps.metrics
    mean, std = ctx.store.manifest(step)["meta"]["score_norm"]
    norm = (mean, std) if isinstance(mean, float | int) else (tuple(mean), tuple(std))
    if not set(eval_sets) <= set(metrics):  # resumed exactly at the last step, or stopped by a request
        metrics |= steps.accuracies(norm)
    metrics |= score_norm_metrics(norm)
    keep = ("rm/loss", "rm/accuracy", "rm/accuracy_online", "rm/score_mean", "rm/score_std", "rm/heads")
    spread = [k for k in metrics if k.endswith(("_std_bottom_half", "_std_top_half")) or k.startswith("rm/head_")]
    summary = {k: metrics[k] for k in (*keep, *spread) if k in metrics} | {"rm/pairs": len(train_rows)}
    return finish(ctx, step, summary, resume, changed)


class _RewardModelSteps:
    """The reward model's part of the stage loop: epochs over the pairs, and at the end the score
    statistics RL normalises with (kept in the last checkpoint) and the held-out accuracies."""

    def __init__(
        self, ctx: StageContext, engine: TrainEngine, tokenizer: Any, cfg: RewardModelConfig, data: RewardModelData,
        rows: tuple[list, torch.Tensor, dict[str, list]], total_steps: int,
    ):
        self.ctx, self.engine, self.tokenizer, self.cfg, self.data = ctx, engine, tokenizer, cfg, data
        (self.train_rows, self.weights, self.eval_sets), self.total_steps = rows, total_steps
        self.pad, self.engines = tokenizer.pad_token_id, (engine,)
        self.metrics: dict[str, float] = {}
        self.norm: ScoreNorm | None = None  # measured at the last step

    def accuracies(self, norm: ScoreNorm) -> dict[str, float]:
        return held_out_accuracies(self.engine.forward, self.eval_sets, self.pad, norm)

    def reference_norm(self) -> ScoreNorm:
        cfg, data = self.cfg, self.data
        reference = [
            encode_pair(self.tokenizer, ex.prompt, ex.response, cfg.max_seq_tokens, ex.tools)
            for ex in load_sft_examples(data.sft, data.storage_options)[: cfg.norm_samples]
        ]
        return score_statistics(self.engine.forward, reference, self.pad)

    def more(self, step: int) -> bool:
        return step < self.total_steps

    def update(self, step: int) -> dict[str, float]:
        ctx, rows, batch_size = self.ctx, self.train_rows, self.cfg.batch_size
        return rm_train_step(self.engine, ctx.runtime, rows, self.weights, self.pad, batch_size, step, ctx)

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        last = step == self.total_steps or stopping
        log = step % self.cfg.log_every == 0 or last
        if last:
            self.norm = self.reference_norm()
            metrics |= score_norm_metrics(self.norm) | self.accuracies(self.norm)
        self.metrics = metrics
        return StepReport(metrics, last, log)

    def commit(self, step: int, whole: bool, last: bool) -> str:
        if last and self.norm is None:  # a stop request while logging made this step the last
            self.norm = self.reference_norm()
        mean, std = self.norm if last else (0.0, 1.0)  # only the last step's statistics are read
        meta = {
            "score_norm": [x if isinstance(x, float) else list(x) for x in (mean, std)],
            "data_position": {"pairs_seen": step * self.cfg.batch_size},
        }
        return save_checkpoint(self.ctx, step, {"model": (self.engine, self.tokenizer)}, meta, whole)
