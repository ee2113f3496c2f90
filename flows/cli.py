"""`rlflow` command line: `rlflow run CONFIG [key=value ...]` and `rlflow demo-assets [DIR]`.

Errors the user can fix (config, data, paths) print one line and exit with code 2; inputs are
checked before the Prefect server starts, so a typo costs a second, not a server start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets as pysecrets
import sys
import time
from pathlib import Path
from typing import Any

from rlflow.engine.errors import RlflowError

PREFECT_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # no internet: telemetry only logs errors
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",  # ~15 s measured, default 20 s is too close
    "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(Path(".rlflow/prefect-results").absolute()),
}


def configure_prefect_env() -> None:
    """Must run before prefect is imported: its settings are read from the environment."""
    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)


def fresh_run_name(config_path: str) -> str:
    return f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}-{pysecrets.token_hex(2)}"


def check_backend(config: Any) -> None:
    """The packages and launch settings the configured execution paths need."""
    import importlib.util

    from rlflow.engine.errors import ConfigError

    if config.engine.backend == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(
                "engine.backend=deepspeed needs the deepspeed package: pip install 'rlflow[deepspeed]'"
                " (or set engine.backend=torch)"
            )
        from rlflow.engine.launch import check_resources

        check_resources(config.resources)
    if config.rollout.mode == "server" and config.rollout.server_backend == "vllm":
        if not os.path.isfile(config.rollout.vllm_python):
            raise ConfigError(
                f"rollout.server_backend=vllm runs in its own environment, but rollout.vllm_python="
                f"{config.rollout.vllm_python!r} does not exist: build it with `make vllm-env` (GPU machines)"
            )


def check_inputs(config: Any) -> None:
    """Fail fast on inputs every stage needs: model path, data files (parsed in full)."""
    from rlflow.engine.run_lock import RunLock
    from rlflow.engine.data import load_preference_pairs, load_prompts, load_sft_examples
    from rlflow.engine.models import resolve_model_path
    from rlflow.engine.placement import validate_placement, visible_gpu_count
    from rlflow.engine.scoring import load_function

    validate_placement(
        config.placement, config.rollout.mode, visible_gpu_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    check_backend(config)
    resolve_model_path(config.model.path)
    d = config.data
    for loader, url in (
        (load_sft_examples, d.sft),
        (load_sft_examples, d.sft_eval),
        (load_preference_pairs, d.preferences),
        (load_preference_pairs, d.preferences_eval),
        (load_prompts, d.prompts),
        (load_prompts, d.eval_prompts),
    ):
        loader(url, d.storage_options)
    load_function(config.gold.fn, "gold.fn")
    load_function(config.label.labeller.fn, "label.labeller.fn")
    # Fails now (one line, exit 2) if another live process holds the run; the flow takes the
    # lock for real.
    RunLock(f"{config.run.root.rstrip('/')}/{config.run.name}", config.run.storage_options).acquire().release()


def command_run(args: argparse.Namespace) -> int:
    from rlflow.engine.config import load_config, split_secrets

    config = load_config(args.config, args.overrides)
    if config.run.name is None:
        config = config.model_copy(update={"run": config.run.model_copy(update={"name": fresh_run_name(args.config)})})
    check_inputs(config)
    public, secret = split_secrets(config.model_dump(mode="json"))
    print(f"rlflow: run '{config.run.name}' -> {config.run.root.rstrip('/')}/{config.run.name}", flush=True)

    from rlflow.flows.rlhf import SECRETS_ENV, format_table, rlhf_flow

    hide_tracebacks_of_user_errors()
    os.environ[SECRETS_ENV] = json.dumps(secret)
    result = rlhf_flow(config=public, source=args.config)
    print(f"\nrun '{result['run']}' finished; final policy: {result['final_policy']}")
    print(format_table(result["rounds"]))
    return 0


class _UserErrorFilter(logging.Filter):
    """Prefect logs a failed task or flow with its traceback; for an error in the user's input
    (an RlflowError) the one-line message says everything, so the traceback is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RlflowError):
            record.exc_info, record.exc_text = None, None
        return True


def hide_tracebacks_of_user_errors() -> None:
    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_UserErrorFilter())


def command_demo_assets(args: argparse.Namespace) -> int:
    from rlflow.engine.demo_task import make_demo_assets

    print(make_demo_assets(args.dir, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlflow", description="RLHF as a Prefect flow: SFT -> reward model -> PPO rounds."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run or continue (same run.name) the pipeline of a config")
    run.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    run.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. ppo.steps=20 run.name=exp1")
    run.set_defaults(handler=command_run)
    assets = sub.add_parser("demo-assets", help="write the demo data, tokenizer and tiny model")
    assets.add_argument("dir", nargs="?", default="demo_assets")
    assets.add_argument("--seed", type=int, default=1234)
    assets.set_defaults(handler=command_demo_assets)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_prefect_env()
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except RlflowError as exc:
        print(f"rlflow: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlflow: interrupted; run the same command again to continue from the last checkpoint", file=sys.stderr)
        return 130


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
