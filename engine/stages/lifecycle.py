"""The resume/commit protocol every stage follows: find the last committed step, restore the
training state, save checkpoints at the cadence, consolidate, and finish with a `final` marker.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import platform
import zlib
from typing import Any

import torch

from rlflow.engine.backend import dist
from rlflow.engine.backend.optim_state import (
    STATE_FILE,
    ShardReader,
    owned,
    restore_rng,
    shard_bytes,
    shard_name,
    state_json,
)
from rlflow.engine.backend.runtime import TrainEngine
from rlflow.engine.errors import CheckpointError
from rlflow.engine.faults import fault_point
from rlflow.engine.models.loading import save_model_dir
from rlflow.engine.seeds import seed_everything, step_seed
from rlflow.engine.stages.context import StageContext, StageOutcome
from rlflow.engine.stages.identity import IDENTITY_FORMAT, changed_keys, legacy_message

log = logging.getLogger(__name__)

# The RL stage was named "ppo" until rlflow 0.2, and a stage's random state is seeded from its name (what
# draws from it: LoRA's adapter initialisation). It keeps the old name's seed, so a config gives the run
# it gave before the rename (bench/summaries.py's lora-s0 differed in its adapters without this).
SEED_NAMES = {"rl": "ppo"}


def completed_outcome(ctx: StageContext) -> StageOutcome | None:
    """The recorded outcome if this stage already finished with the same identity.

    A finished stage with a different identity is an error saying what changed: re-running it
    would silently replace an output later stages were trained from.
    """
    if ctx.mirror is not None:
        if dist.is_main():  # a final.json or step lost or damaged on the primary comes back from the mirror
            ctx.mirror.repair_final()
        dist.barrier()  # the other ranks read final.json once rank 0 has repaired it
    final = ctx.store.final()
    if final is None:
        return None
    changed: tuple[str, ...] = ()
    if final.get("identity") != ctx.identity:
        _refuse_legacy(ctx, final.get("identity_tree", {}))
        changed = changed_keys(final.get("identity_tree", {}), ctx.identity_tree)
        if not ctx.allow_config_change:
            raise CheckpointError(
                f"stage round_{ctx.round_index}/{ctx.stage} at {ctx.store.url} already finished with a different "
                f"configuration or inputs (changed: {', '.join(changed[:8])}); use a new run.name to run it again, "
                "or resume.allow_config_change=true to keep its output"
            )
        log.warning("%s: finished under another configuration (changed: %s); its output is kept", ctx.label, changed)
    return StageOutcome(
        stage=ctx.stage,
        round_index=ctx.round_index,
        step=final["step"],
        checkpoint_uri=ctx.store.step_url(final["step"]),
        manifest_sha256=final["manifest_sha256"],
        metrics=final.get("metrics", {}),
        skipped=True,
        changed_keys=changed,
    )


def _refuse_legacy(ctx: StageContext, recorded: dict[str, Any]) -> None:
    """A stage written by an rlflow before identities were derived from the stage's inputs has no
    identity this rlflow can compare: never continued or kept, whatever resume.allow_config_change says."""
    if recorded.get("format") != IDENTITY_FORMAT:
        raise CheckpointError(legacy_message(f"stage round_{ctx.round_index}/{ctx.stage} at {ctx.store.url}"))


def software_versions() -> dict[str, str]:
    """Versions recorded with every checkpoint (metadata lookups: nothing heavy is imported)."""
    versions = {"python": platform.python_version()}
    for package in ("rlflow", "torch", "transformers", "deepspeed", "safetensors"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return versions


def save_checkpoint(
    ctx: StageContext,
    step: int,
    engines: dict[str, tuple[TrainEngine, Any]],
    meta: dict[str, Any],
    consolidate: bool,
    protect: set[int] | frozenset[int] = frozenset(),
    files: dict[str, Any] | None = None,
) -> str:
    """Commit one step from all ranks (a collective: every rank calls it).

    Each rank writes its optimizer shard of every engine; with `consolidate`, rank 0 also writes
    each model as an HF directory (safetensors) under its prefix; then rank 0 writes the training
    state and the manifest, the commit point. `engines`: prefix -> (engine, tokenizer or None);
    `files`: further JSON files of rank 0's state (name -> value), committed with the step.
    """
    rank, world = dist.rank(), dist.world_size()
    with ctx.store.writer(step) if dist.is_main() else contextlib.nullcontext() as writer:
        dist.barrier()  # rank 0 has cleared any debris of this step before others write into it
        records, engines_meta = {}, {}
        for prefix, (engine, tokenizer) in engines.items():
            names = engine.param_names()
            mine = {}
            for index, name in enumerate(names):
                state = engine.full_param_state(name)  # a collective under ZeRO-3: every rank, every name
                if owned(index, rank, world):
                    mine[name] = state
            shard = shard_name(prefix, rank)
            records[shard] = ctx.store.put_shard(step, shard, shard_bytes(mine))
            state_dict = engine.gathered_state_dict() if consolidate else None
            if writer is not None and consolidate:
                save_model_dir(engine.model, tokenizer, writer, prefix, state_dict)
            engines_meta[prefix] = {
                "adam_step": engine.adam_step(),
                "world_size": world,
                "schedule": engine.schedule.state_dict(),
            }
        every_rank = dist.all_gather_json(records)
        if writer is not None:
            for rank_records in every_rank:
                for name, record in rank_records.items():
                    writer.adopt(name, record)
            fault_point(ctx.stage, "ckpt_files", step)
            writer.write_bytes(STATE_FILE, state_json(engines_meta))
            for name, value in (files or {}).items():
                writer.write_json(name, value)
            writer.meta.update(
                meta,
                identity=ctx.identity,
                identity_tree=ctx.identity_tree,
                versions=software_versions(),
                consolidated=consolidate,
            )
    dist.barrier()
    if dist.is_main():
        fault_point(ctx.stage, "ckpt_manifest", step)
        # The step just written always survives: steps left by an abandoned run with another
        # identity must not push it out of keep_last.
        spare = set(protect) | {step}
        if ctx.mirror is not None:  # copied in the background; steps not on the mirror yet stay
            ctx.mirror.submit(step, keep=set(protect))
            spare |= ctx.mirror.protected()
        ctx.store.prune(ctx.keep_last, protect=spare)
    dist.barrier()
    return ctx.store.step_url(step)


def should_consolidate(ctx: StageContext, step: int, last: bool) -> bool:
    """Whole HF model directories at the stage's end and every `consolidate_every`-th checkpoint."""
    return last or (step // ctx.every_steps) % ctx.consolidate_every == 0


def start_stage(ctx: StageContext) -> tuple[int | None, tuple[str, ...]]:
    """Seed every RNG from (run seed, round, stage), so a process's random state never depends on
    what ran before it; return the step to resume from (None: start afresh) and, when that step
    was written under another identity (resume.allow_config_change), the keys that changed.

    An interrupted stage whose config, inputs or data changed is an error otherwise: resuming
    would silently mix two configurations, restarting would silently drop the steps done."""
    seed_everything(step_seed(ctx.seed, ctx.round_index, zlib.crc32(SEED_NAMES.get(ctx.stage, ctx.stage).encode())))
    step, newest = latest_resumable(ctx), ctx.store.latest()
    if newest is None or newest == step or _resumable(ctx, ctx.store.manifest(newest)["meta"]):
        if step is not None:
            _warn_on_version_change(ctx, step)
        return step, ()
    recorded = ctx.store.manifest(newest)["meta"].get("identity_tree", {})
    _refuse_legacy(ctx, recorded)
    changed = changed_keys(recorded, ctx.identity_tree)
    if not ctx.allow_config_change:
        raise CheckpointError(
            f"stage round_{ctx.round_index}/{ctx.stage} at {ctx.store.url} was interrupted at step {newest} under a "
            f"different configuration or inputs (changed: {', '.join(changed[:8])}); continue it with "
            "resume.allow_config_change=true (the changed keys become MLflow tags) or use a new run.name"
        )
    log.warning("%s: continuing step %d under a changed configuration (changed: %s)", ctx.label, newest, changed)
    if dist.is_main():
        _verify(ctx, newest)
    return newest, changed


def _warn_on_version_change(ctx: StageContext, step: int) -> None:
    recorded, current = ctx.store.manifest(step)["meta"].get("versions", {}), software_versions()
    changed = {k: (recorded[k], v) for k, v in current.items() if k in recorded and recorded[k] != v}
    if changed:
        log.warning("%s: resuming step %d written by other software versions: %s", ctx.label, step, changed)


def latest_resumable(ctx: StageContext) -> int | None:
    """Latest committed step of this stage's identity (steps from another identity are ignored).

    With a mirror, rank 0 also considers the mirror's steps, verifies the chosen step's files
    (sha256) and restores it from the mirror when the primary's copy is gone or damaged; every
    rank resumes from that step."""
    if ctx.mirror is not None:
        return dist.all_gather_json(_resumable_with_mirror(ctx) if dist.is_main() else None)[0]
    pick = None
    if dist.is_main():  # one rank hashes; the others resume from what it found
        steps = reversed(ctx.store.committed_steps())
        pick = next((s for s in steps if _resumable(ctx, ctx.store.manifest(s)["meta"])), None)
        if pick is not None:
            _verify(ctx, pick)
    return dist.all_gather_json(pick)[0]


def _verify(ctx: StageContext, step: int) -> None:
    """Re-hash a step before resuming from it (rank 0); a damaged file stops the stage untouched."""
    try:
        ctx.store.verify(step)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc}; nothing was changed: delete {ctx.store.step_url(step)} to resume from the step before "
            "it (checkpoint.mirror keeps a second copy that repairs this by itself)"
        ) from None


def _resumable(ctx: StageContext, meta: dict[str, Any]) -> bool:
    """Whether a step (by its manifest meta) can resume this stage; one rule for both stores."""
    return meta.get("identity") == ctx.identity


def _resumable_with_mirror(ctx: StageContext) -> int | None:
    """latest_resumable over the primary's and the mirror's steps (rank 0); the chosen step is
    verified on the primary and restored from the mirror if needed."""
    assert ctx.mirror is not None
    primary = set(ctx.store.committed_steps())
    for step in sorted(primary | set(ctx.mirror.mirrored_steps()), reverse=True):
        store = ctx.store if step in primary else ctx.mirror.replica
        if _resumable(ctx, store.manifest(step)["meta"]):
            ctx.mirror.repair(step)
            return step
    return None


def restore_training_state(ctx: StageContext, step: int, engines: dict[str, TrainEngine]) -> dict[str, Any]:
    """Load weights, Adam state and schedule of every engine from `step`, whatever world size wrote
    it; restore the RNG; return the step's manifest meta. A collective under ZeRO-3."""
    local = ctx.store.local_dir(step)
    with open(os.path.join(local, STATE_FILE), "rb") as f:
        state = json.loads(f.read())
    for prefix, engine in engines.items():
        saved = state["engines"].get(prefix)
        if saved is None:
            raise CheckpointError(f"{ctx.store.step_url(step)} has no optimizer state for {prefix!r}")
        reader = ShardReader(local, prefix, saved["world_size"])
        missing = sorted(set(engine.param_names()) - reader.names())
        if missing:
            raise CheckpointError(
                f"{ctx.store.step_url(step)}: optimizer shards of {prefix!r} lack parameters {missing[:3]}; "
                "the model architecture changed since this checkpoint"
            )
        engine.set_adam_step(saved["adam_step"])
        for name in engine.param_names():
            engine.restore_param(name, reader)
        engine.schedule.load_state_dict(saved["schedule"])
        for group, lr in zip(engine.schedule.optimizer.param_groups, engine.schedule.get_last_lr()):
            group["lr"] = lr  # a scheduler's load_state_dict does not touch the optimizer
    restore_rng(state["rng"])
    return ctx.store.manifest(step)["meta"]


def finish(
    ctx: StageContext,
    step: int,
    metrics: dict[str, float],
    resumed_from: int | None,
    changed: tuple[str, ...] = (),
) -> StageOutcome:
    metrics = {k: float(v) for k, v in metrics.items()}
    if not dist.is_main():  # rank 0 records the outcome; the others only report what it will say
        url = ctx.store.step_url(step)
        return StageOutcome(
            stage=ctx.stage,
            round_index=ctx.round_index,
            step=step,
            checkpoint_uri=url,
            manifest_sha256="",
            metrics=metrics,
            resumed_from=resumed_from,
            changed_keys=changed,
        )
    fault_point(ctx.stage, "before_final", step)
    record = ctx.store.mark_final(
        step, {"identity": ctx.identity, "identity_tree": ctx.identity_tree, "metrics": metrics}
    )
    fault_point(ctx.stage, "after_final", step)
    if ctx.mirror is not None:
        _settle_mirror(ctx, step)
    ctx.sink.log_text("checkpoint_uri.txt", ctx.store.step_url(step) + "\n")
    return StageOutcome(
        stage=ctx.stage,
        round_index=ctx.round_index,
        step=step,
        checkpoint_uri=ctx.store.step_url(step),
        manifest_sha256=record["manifest_sha256"],
        metrics=metrics,
        resumed_from=resumed_from,
        changed_keys=changed,
    )


def _settle_mirror(ctx: StageContext, step: int) -> None:
    """Stage end (rank 0): mirror final.json after its step, wait up to the mirror's finish_wait_s
    (5 min) for it to catch up, stop its thread, then prune the primary steps it no longer needs."""
    assert ctx.mirror is not None
    ctx.mirror.submit_final(step)
    ctx.mirror.close(wait_s=ctx.mirror.finish_wait_s)  # warns itself when it did not catch up
    if ctx.mirror.saved:  # the last save's prune again: steps it held back for the mirror may go now
        ctx.store.prune(ctx.keep_last, protect=ctx.mirror.protected())


def set_threads(configured: int) -> None:
    """torch's CPU threads for this process: $OMP_NUM_THREADS when set (a launcher or scheduler that
    packs processes onto cores knows better than the config), `configured` (run.threads) otherwise."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or configured)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
