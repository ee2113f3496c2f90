"""DPO as a round's training stage: the policy learns from preference pairs directly.

No reward model, no sampling: a frozen reference's log-probs of every chosen and rejected answer
are computed once, before training, and the policy is trained with the DPO loss
(engine/algorithms/dpo_loss.py) against them. The reference is then freed, so training holds one model.

Reference log-probs are recomputed on resume rather than stored in checkpoints: the reference is
a stage input (part of the identity, so it is still there and unchanged), one forward pass over
the pairs costs about a third of one training epoch's compute, and the pass is deterministic:
it cuts the pairs into fixed contiguous chunks that depend on the config only, never on the world
size or the micro-batch cuts. Each checkpoint records the sha256 of the values; a resume that
recomputes different ones (other hardware or kernels) says so.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import math
from typing import Any, Literal

import torch
from rlflow.engine.backend import dist
from rlflow.engine.backend.runtime import LossParts, OptimSpec, Runtime, TrainEngine
from rlflow.engine.data.batching import PromptResponseIds, batch_indices, pack_rows, rank_shard, right_pad
from rlflow.engine.config.base import SectionView
from rlflow.engine.config.schema import Config, DataConfig
from rlflow.engine.config.execution import EngineConfig
from rlflow.engine.config.methods import DPOConfig
from rlflow.engine.data.records import PreferencePair, load_preference_pairs
from rlflow.engine.algorithms.dpo_loss import chosen_nll, dpo_loss
from rlflow.engine.errors import DataError
from rlflow.engine.models.lm_head import next_token_logprobs
from rlflow.engine.models.lora import lora_metrics
from rlflow.engine.models.loading import load_policy, load_tokenizer, model_device, model_kwargs, position_ids_from_mask
from rlflow.engine.stages.reward_model import _pair_rows
from rlflow.engine.stages.context import Record, StageContext, StageOutcome
from rlflow.engine.stages.inputs import LabelsInput, ModelInput, ModelLoading, StageInputs
from rlflow.engine.stages.lifecycle import finish, restore_training_state, save_checkpoint
from rlflow.engine.stages.loop import StageStart, StepReport, run_stage_loop

log = logging.getLogger(__name__)

PAIR_ORDER_STREAM = 11  # batch_indices seed stream of DPO's pair order (SFT 1, RM 2, ... round stages 10)
PairRows = list[tuple[PromptResponseIds, PromptResponseIds]]
SUMMARY = ("dpo/loss", "dpo/rewards/accuracy", "dpo/rewards/margin")  # the last step's, in the outcome
EVAL = ("dpo/eval_accuracy", "dpo/eval_margin")


def sequence_logps(
    model: torch.nn.Module, sequences: list[PromptResponseIds], pad_id: int, packed: bool = False
) -> torch.Tensor:
    """log pi(response | prompt) of each sequence: [N] float32 nats, summed over response tokens
    (EOS included), on the model's device. One forward pass: right-padded, or `packed` in one row."""
    device = model_device(model)
    if packed:
        batch = pack_rows(sequences)
        ids, mask = batch.input_ids.to(device), batch.response_mask.to(device)
        forward = {"attention_mask": None, "position_ids": batch.position_ids.to(device)}
    else:
        ids, attention, mask = (t.to(device) for t in right_pad(sequences, pad_id))
        forward = {"attention_mask": attention, "position_ids": position_ids_from_mask(attention)}
    # Token t is predicted at position t-1; the LM head runs in chunks (engine/models/lm_head.py).
    token, _ = next_token_logprobs(model, ids, forward | {"use_cache": False}, 1)
    token = token * mask[:, 1:]  # prompt and padding (and a packed row's next prompt) count nothing
    if not packed:
        return token.sum(-1)
    # Packed: target position t belongs to the first row whose last position is >= t.
    row = torch.searchsorted(batch.ends.to(device), torch.arange(1, ids.shape[1], device=device))
    return torch.zeros(len(sequences), device=device).index_add_(0, row, token[0])


def pair_logps(model, rows: PairRows, pad_id: int, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs [n] of the chosen and of the rejected answers of n pairs (one pass)."""
    logps = sequence_logps(model, [c for c, _ in rows] + [r for _, r in rows], pad_id, packed)
    return logps[: len(rows)], logps[len(rows) :]


def all_pair_logps(model, rows: PairRows, pad_id: int, chunk: int) -> torch.Tensor:
    """[N, 2] float32 CPU (chosen, rejected) summed log-probs of every pair, on every rank.

    The pairs are cut into contiguous chunks of `chunk`, each rank scoring chunks rank, rank +
    world, ...: a chunk's padding (so its values) does not depend on the world size. The caller
    chooses the grad mode (inference for a frozen model, no_grad for a trainable one)."""
    parts = []
    for c, real in dist.rank_chunks(len(rows), chunk):
        chosen, rejected = pair_logps(model, rows[c * chunk : (c + 1) * chunk], pad_id)
        if real:
            parts.append(torch.stack([chosen, rejected], 1).float().cpu())
    local = torch.cat(parts) if parts else torch.zeros(0, 2)
    return dist.gather_chunked(local, len(rows), chunk, 0.0)


def pass_pairs(engine_cfg: EngineConfig, cfg: DPOConfig) -> int:
    """Pairs per inference pass (reference, evaluation): no more than a training micro-batch may
    hold, and a function of the config only, so a resume cuts the same chunks."""
    n = min(engine_cfg.micro_batch_size or cfg.batch_size, cfg.batch_size)
    if engine_cfg.max_tokens_per_microbatch:  # a pair is at most 2 x max_seq_tokens padded tokens
        n = min(n, max(1, engine_cfg.max_tokens_per_microbatch // (2 * cfg.max_seq_tokens)))
    return n


def reference_logps(
    runtime: Runtime, reference_path: str, model_cfg: ModelLoading, rows: PairRows, pad_id: int, chunk: int
) -> torch.Tensor:
    """[N, 2] (chosen, rejected) summed log-probs under the frozen reference; the model is freed."""
    reference = runtime.frozen(lambda: load_policy(reference_path, key="reference", **model_kwargs(model_cfg)))
    with runtime.inference(), runtime.onloaded(reference):
        logps = all_pair_logps(reference, rows, pad_id, chunk)
    del reference
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return logps.clone()  # a normal tensor: inference-mode tensors may not meet autograd later


def logps_sha256(logps: torch.Tensor) -> str:
    return hashlib.sha256(logps.contiguous().numpy().tobytes()).hexdigest()


def load_dpo_pairs(
    data: DPOData, preference_files: tuple[str, ...], include_offline: bool
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(training pairs, clean held-out pairs). Training: data.preferences when `include_offline`,
    plus every file of `preference_files`. Tied pairs (chosen == rejected) carry no preference and
    have a zero gradient: dropped from both."""
    urls = ([data.preferences] if include_offline and data.preferences else []) + list(preference_files)
    train = [p for url in urls for p in load_preference_pairs(url, data.storage_options) if p.chosen != p.rejected]
    if not train:
        where = ", ".join(urls) if urls else "no files (dpo.include_offline is false and no online pairs were given)"
        raise DataError(f"DPO has no preference pairs to train on: read {where}")
    held_out = load_preference_pairs(data.preferences_eval, data.storage_options)
    return train, [p for p in held_out if p.chosen != p.rejected]


def dpo_train_step(
    engine: TrainEngine,
    runtime: Runtime,
    rows: PairRows,
    ref: torch.Tensor,
    pad_id: int,
    cfg: DPOConfig,
    step: int,
    ctx: StageContext,
) -> dict[str, float]:
    """One optimizer step of the DPO loss averaged over every pair of global batch `step`.

    rows: all training pairs; ref: their reference log-probs [N, 2]. The pair is the loss unit, so
    the mean does not depend on how the batch is cut into micro-batches and ranks."""
    indices = batch_indices(len(rows), cfg.batch_size, step, ctx.seed, ctx.round_index, PAIR_ORDER_STREAM)
    mine = rank_shard(indices, dist.rank(), dist.world_size())
    packed = runtime.cfg.packing
    if packed:  # a pair costs its two sequences' real tokens
        groups = runtime.packed_micro_batches([sum(len(x.prompt) + len(x.response) for x in rows[j]) for j in mine])
    else:  # a pair is two sequences padded to the longer one
        groups = runtime.micro_batches([2 * max(len(x.prompt) + len(x.response) for x in rows[j]) for j in mine])
    batches = [[mine[g] for g in group] for group in groups]

    def loss_fn(model, batch: list[int]) -> LossParts:
        chosen, rejected = pair_logps(model, [rows[j] for j in batch], pad_id, packed)
        pair_ref = ref[batch].to(chosen.device)
        loss, r_chosen, r_rejected = dpo_loss(
            chosen, rejected, pair_ref[:, 0], pair_ref[:, 1], cfg.beta, cfg.label_smoothing
        )
        tokens = torch.tensor([len(rows[j][0].response) for j in batch], device=chosen.device)
        nll = chosen_nll(chosen, tokens)
        if cfg.rpo_alpha:
            loss = loss + cfg.rpo_alpha * nll
        n = float(len(batch))
        stats = {
            "dpo/nll": nll.detach().sum(),
            "dpo/rewards/chosen": r_chosen.sum(),
            "dpo/rewards/rejected": r_rejected.sum(),
            "dpo/rewards/accuracy": (r_chosen > r_rejected).float().sum(),
            "dpo/rewards/margin": (r_chosen - r_rejected).sum(),
            "dpo/logps/chosen": chosen.detach().sum(),  # a falling chosen log-prob is DPO's known drift
            "dpo/logps/rejected": rejected.detach().sum(),
        }
        sums = torch.stack(list(stats.values())).tolist()  # one device sync, not one per metric
        return LossParts(loss.sum(), n, {k: (v, n) for k, v in zip(stats, sums)})

    out = engine.train_step(batches, [float(len(b)) for b in batches], loss_fn)
    names = {"dpo/loss": "loss", "dpo/grad_norm": "grad_norm", "dpo/lr": "lr", "skipped": "skipped"}
    return {name: out[key] for name, key in names.items()} | {k: v for k, v in out.items() if k.startswith("dpo/")}


def evaluate(engine: TrainEngine, rows: PairRows, ref: torch.Tensor, pad_id: int, chunk: int, beta: float) -> dict:
    """Implicit-reward accuracy (share of pairs whose chosen reward is strictly higher) and mean
    reward margin (nats x beta) on held-out pairs, labels taken as given; {} without pairs."""
    if not rows:
        return {}
    engine.forward.eval()
    with torch.no_grad():
        logps = all_pair_logps(engine.forward, rows, pad_id, chunk)
    engine.forward.train()
    margin = beta * ((logps[:, 0] - ref[:, 0]) - (logps[:, 1] - ref[:, 1]))
    return dict(zip(EVAL, (float((margin > 0).float().mean()), float(margin.mean()))))


class DPOData(SectionView, source=DataConfig):
    """The data.* keys DPO reads."""

    preferences: str | None
    preferences_eval: str | None
    chat_template: Literal["auto", "none"]
    storage_options: dict[str, Any]


class DPOUpstream(Record):
    init: ModelInput  # the policy to start from
    reference: ModelInput  # the frozen reference policy (dpo.reference)
    labels: LabelsInput | None = None  # the round's online-labelled pairs of the starting policy (online DPO)


class DPOInputs(StageInputs):
    """Everything the DPO stage reads."""

    upstream: DPOUpstream
    model: ModelLoading
    dpo: DPOConfig  # beta, loss, optimizer, epochs, batch size, include_offline
    data: DPOData


def inputs_from(config: Config, upstream: DPOUpstream) -> DPOInputs:
    return DPOInputs(
        seed=config.run.seed,
        upstream=upstream,
        model=ModelLoading.for_stage(config.model, "dpo"),
        dpo=config.dpo,
        data=DPOData.of(config.data),
    )


def run_dpo_stage(ctx: StageContext, inputs: DPOInputs, start: StageStart) -> StageOutcome:
    """Train the policy from `upstream.init` with DPO against the frozen policy `upstream.reference`.

    Pairs: data.preferences when dpo.include_offline, plus the upstream labels' pairs; held-out
    accuracy on data.preferences_eval (clean labels). The final checkpoint holds the policy as an HF
    directory `model` (with its tokenizer), like SFT's."""
    resume, changed, guard = start
    cfg, data = inputs.dpo, inputs.data
    init, labels = inputs.upstream.init.uri, inputs.upstream.labels
    tokenizer = load_tokenizer(init, inputs.model.trust_remote_code, chat_template=data.chat_template)
    pad = tokenizer.pad_token_id
    files = (labels.train,) if labels is not None and labels.train is not None else ()
    train_pairs, eval_pairs = load_dpo_pairs(data, files, cfg.include_offline)
    rows = _pair_rows(tokenizer, train_pairs + eval_pairs, cfg.max_seq_tokens)
    chunk = pass_pairs(ctx.runtime.cfg, cfg)
    # Before the policy is loaded: one model in memory at a time.
    ref = reference_logps(ctx.runtime, inputs.upstream.reference.uri, inputs.model, rows, pad, chunk)
    train_rows, eval_rows = rows[: len(train_pairs)], rows[len(train_pairs) :]
    train_ref, eval_ref = ref[: len(train_pairs)], ref[len(train_pairs) :]
    ref_sha = logps_sha256(ref)
    total_steps = cfg.epochs * math.ceil(len(train_rows) / cfg.batch_size)
    optim = OptimSpec(cfg.lr, cfg.weight_decay, cfg.warmup_steps, total_steps, cfg.max_grad_norm)
    load = lambda: load_policy(init, **model_kwargs(inputs.model))  # noqa: E731
    engine = ctx.runtime.trainable("model", load, optim, lora=inputs.model.lora)  # only adapters, if any
    if inputs.model.lora:
        ctx.sink.log_metrics(lora_metrics("policy", engine.model), 0)
    engine.train()
    step, metrics = 0, {}
    if resume is not None:
        meta = restore_training_state(ctx, resume, {"model": engine})
        _check_reference(ctx, meta.get("reference_logps_sha256"), ref_sha)
        step, metrics = resume, dict(meta.get("train_metrics", {}))  # the summary's, if no step is left to run
    train, held_out = (train_rows, train_ref), (eval_rows, eval_ref)
    steps = _DPOSteps(ctx, engine, tokenizer, cfg, (train, held_out), (total_steps, chunk), ref_sha, metrics)
    step = run_stage_loop(ctx, guard, steps, step).step
    metrics = steps.metrics
    if EVAL[0] not in metrics:  # resumed exactly at the last step, or stopped by a request while logging
        metrics |= steps.evaluate()
    summary = {k: metrics[k] for k in SUMMARY + EVAL if k in metrics} | guard.early_stop_metrics()
    return finish(ctx, step, summary | {"dpo/pairs": len(train_rows), "dpo/steps": step}, resume, changed)


class _DPOSteps:
    """DPO's part of the stage loop: epochs over the pairs against the precomputed reference
    log-probs, held-out accuracy at the end."""

    def __init__(
        self, ctx: StageContext, engine: TrainEngine, tokenizer: Any, cfg: DPOConfig, pairs, sizes, ref_sha, metrics
    ):
        self.ctx, self.engine, self.tokenizer, self.cfg, self.ref_sha = ctx, engine, tokenizer, cfg, ref_sha
        self.pad, self.engines = tokenizer.pad_token_id, (engine,)
        (self.train_rows, self.train_ref), (self.eval_rows, self.eval_ref) = pairs
        self.total_steps, self.chunk = sizes  # optimizer steps, pairs per forward pass
        self.metrics: dict[str, float] = metrics  # the last step's; a resume's come from its checkpoint

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.engine, self.eval_rows, self.eval_ref, self.pad, self.chunk, self.cfg.beta)

    def more(self, step: int) -> bool:
        return step < self.total_steps

    def update(self, step: int) -> dict[str, float]:
        ctx, cfg = self.ctx, self.cfg
        return dpo_train_step(self.engine, ctx.runtime, self.train_rows, self.train_ref, self.pad, cfg, step, ctx)

    def report(self, step: int, metrics: dict[str, float], stopping: bool) -> StepReport:
        last = step == self.total_steps or stopping
        if last:
            metrics |= self.evaluate()
        self.metrics = metrics
        return StepReport(metrics, last, log=step % self.cfg.log_every == 0 or last)

    def commit(self, step: int, whole: bool, last: bool) -> str:
        meta = _checkpoint_meta(self.ref_sha, self.metrics, step * self.cfg.batch_size)
        return save_checkpoint(self.ctx, step, {"model": (self.engine, self.tokenizer)}, meta, whole)


def _checkpoint_meta(ref_sha: str, metrics: dict[str, float], pairs_seen: int) -> dict:
    """What a DPO checkpoint records besides the engine state: the reference values' hash, and the
    step's summary metrics (a stage resumed at its last step reports them without training)."""
    return {
        "reference_logps_sha256": ref_sha,
        "train_metrics": {k: metrics[k] for k in SUMMARY if k in metrics and math.isfinite(metrics[k])},
        "data_position": {"pairs_seen": pairs_seen},
    }


def _check_reference(ctx: StageContext, recorded: str | None, current: str) -> None:
    """The recomputed reference log-probs should be bit-identical to those the checkpoint was
    trained with; other hardware or kernels may round differently (the stage goes on with them)."""
    if recorded is not None and recorded != current:
        log.warning(
            "%s: the reference log-probs recomputed on resume differ from the interrupted run's (other hardware"
            " or kernels?); training continues with the new values, so it will not repeat that run bit for bit",
            ctx.label,
        )
