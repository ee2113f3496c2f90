"""`rlflow export RUN --round N --to DIR_OR_URL`: a round's policy as a clean Hugging Face
directory with a model card of its lineage (from the MLflow registry) and evaluation table."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.errors import ConfigError
from rlflow.flows.plan import load_run_config, read_run_file
from rlflow.flows.wiring import final_stage

EVAL_COLUMNS = ("round", "gold_score_before", "gold_score_after", "kl", "rm_accuracy", "response_length")


def lineage_of(config: Any, round_index: int) -> dict[str, str]:
    """The registered version's lineage tags (rlflow.*) of that round; {} if none is registered."""
    from rlflow.tasks.tracking import registered_model_name, round_version, tracking_client

    client = tracking_client(config.tracking.uri, config.run.root)
    try:
        version = round_version(client, config.run.name, round_index)
    except Exception as exc:  # noqa: BLE001 - an unreachable store: the card says so
        return {"registry": f"unavailable ({exc.__class__.__name__})"}
    if version is None:
        return {}
    tags = {k.removeprefix("rlflow."): v for k, v in version.tags.items() if k.startswith("rlflow.")}
    return {"registered_model": f"{registered_model_name(config.run.name)} version {version.version}"} | tags


def command_export(args: argparse.Namespace) -> int:
    from rlflow.engine.storage.export import ModelCard, export_policy

    config = load_run_config(args.root, args.run)
    store = CheckpointStore(
        stage_prefix(config.run.root, config.run.name, args.round, final_stage(config)), config.run.storage_options
    )
    final = store.final()
    if final is None:
        raise ConfigError(
            f"round {args.round} of run '{args.run}' has no final policy ({store.url}); see `rlflow status`"
        )
    summary = read_run_file(args.root, args.run, "summary.json", config.run.storage_options)
    rows = json.loads(summary)["rounds"] if summary else []
    card = ModelCard(
        run_name=config.run.name,
        round_index=args.round,
        stage=final_stage(config),
        step_uri=store.step_url(final["step"]),
        base_model=config.model.path,
        lineage=lineage_of(config, args.round),
        evaluation=[{k: row.get(k) for k in EVAL_COLUMNS} for row in rows if row["round"] <= args.round],
    )
    sampling = config.sampling.model_dump()
    result = export_policy(
        card.step_uri, config.run.storage_options, args.to, {}, card, sampling=sampling, overwrite=args.overwrite
    )
    print(f"exported round {args.round} of '{args.run}' ({result.n_params:,} parameters, {result.total_bytes:,} bytes)")
    print(f"  -> {result.dest}: {', '.join(result.files)}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="a round's policy as a clean Hugging Face directory with a model card")
    p.add_argument("run", help="run.name")
    p.add_argument("--round", type=int, required=True)
    p.add_argument("--to", required=True, help="a local folder or an fsspec URL (s3://bucket/prefix)")
    p.add_argument("--root", default="runs")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty destination")
    p.set_defaults(handler=command_export)
