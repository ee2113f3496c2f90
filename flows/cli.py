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

from rlflow.engine.errors import RlflowError, RunHalted, StagePreempted

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


def check_devices(config: Any) -> None:
    """GPU placement, and one device per rank of this node (see placement.validate_process_count)."""
    from rlflow.engine.placement import usable_cpu_count, validate_placement, validate_process_count, visible_gpu_count

    gpus, cvd = visible_gpu_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    validate_placement(config.placement, config.rollout.mode, gpus, cvd)
    validate_process_count(config.resources.nproc_per_node, config.placement.train, gpus, usable_cpu_count(), cvd)


def _for_key(key: str, fn: Any, *args: Any) -> Any:
    """fn(*args), a DataError's message led by the config key that named the file."""
    from rlflow.engine.errors import DataError

    try:
        return fn(*args)
    except DataError as exc:
        raise DataError(f"{key}: {exc}") from None


def check_prompt_lengths(config: Any, prompt_sets: dict[str, list[Any]]) -> None:
    """With data.prompt_overflow=drop, a prompt set left empty would fail the label or PPO stage,
    after SFT and the reward model have trained: tokenizing the prompts now takes a second."""
    if config.data.prompt_overflow != "drop":
        return
    from rlflow.engine.evaluation import encode_prompt_set
    from rlflow.engine.models import load_tokenizer

    tokenizer = load_tokenizer(config.model.path, config.model.trust_remote_code)
    for key, records in prompt_sets.items():
        url = getattr(config.data, key)
        _for_key(f"data.{key}", encode_prompt_set, tokenizer, records, config.data.max_prompt_tokens, "drop", url)


def check_reward_model_vocabulary(config: Any) -> None:
    """rm.init given as a model: PPO feeds it the policy's token ids, so it must share the policy's
    tokenizer. A remote committed step is not downloaded for this check."""
    init = config.rm.init
    if init == "sft" or "://" in init:
        return
    from rlflow.engine.checkpoint import model_location
    from rlflow.engine.models import check_shared_vocabulary, resolve_model_path

    path = resolve_model_path(model_location(init, {}), "rm.init")
    check_shared_vocabulary(config.model.path, path, config.model.trust_remote_code)


def check_run_root(config: Any) -> None:
    """Fails now (one line, exit 2) if run.root cannot be written (a missing bucket, refused
    credentials) or another live process holds the run; the flow takes the lock for real."""
    from rlflow.engine.errors import ConfigError
    from rlflow.engine.run_lock import RunLock
    from rlflow.engine.storage_errors import STORAGE_ERRORS, describe_storage_error

    url, options = f"{config.run.root.rstrip('/')}/{config.run.name}", config.run.storage_options
    try:
        RunLock(url, options).acquire().release()
    except STORAGE_ERRORS as exc:
        reason = describe_storage_error(url, exc, options, "run.storage_options")
        raise ConfigError(f"run.root {config.run.root!r} cannot be written: {reason}") from None


def check_mirror(config: Any) -> None:
    """checkpoint.mirror must take a write now: a mirror misconfigured from the start would look
    like an endless outage, and the primary would keep every step for it."""
    if not config.checkpoint.mirror:
        return
    import uuid

    from fsspec.core import url_to_fs

    from rlflow.engine.errors import ConfigError
    from rlflow.engine.storage_errors import STORAGE_ERRORS, describe_storage_error

    url, options = f"{config.checkpoint.mirror.rstrip('/')}/{config.run.name}", config.checkpoint.mirror_storage_options
    try:
        fs, path = url_to_fs(url, **options)
        probe = f"{path.rstrip('/')}/.rlflow-probe-{uuid.uuid4().hex}"
        if "file" in fs.protocol:  # a local folder is made; a missing bucket must stay an error
            fs.makedirs(path, exist_ok=True)
        fs.pipe_file(probe, b"probe")
        fs.rm(probe)
    except STORAGE_ERRORS as exc:
        reason = describe_storage_error(url, exc, options, "checkpoint.mirror_storage_options")
        raise ConfigError(f"checkpoint.mirror {config.checkpoint.mirror!r} cannot be written: {reason}") from None


def check_inputs(config: Any) -> None:
    """Fail fast on inputs every stage needs: devices, model paths, data files (parsed in full),
    and where checkpoints go."""
    from rlflow.engine.data import load_preference_pairs, load_prompts, load_sft_examples
    from rlflow.engine.models import resolve_model_path
    from rlflow.engine.scoring import load_function

    check_devices(config)
    check_backend(config)
    resolve_model_path(config.model.path)
    d = config.data
    loaders = {"sft": load_sft_examples, "sft_eval": load_sft_examples}
    loaders |= {"preferences": load_preference_pairs, "preferences_eval": load_preference_pairs}
    loaders |= {"prompts": load_prompts, "eval_prompts": load_prompts}
    loaded = {key: _for_key(f"data.{key}", fn, getattr(d, key), d.storage_options) for key, fn in loaders.items()}
    check_prompt_lengths(config, {key: loaded[key] for key in ("prompts", "eval_prompts")})
    check_reward_model_vocabulary(config)
    load_function(config.gold.fn, "gold.fn")
    load_function(config.label.labeller.fn, "label.labeller.fn")
    check_run_root(config)
    check_mirror(config)


def command_run(args: argparse.Namespace) -> int:
    from rlflow.engine.config import load_config
    from rlflow.engine.secrets import split_secrets

    config = load_config(args.config, args.overrides)
    if config.run.name is None:
        config = config.model_copy(update={"run": config.run.model_copy(update={"name": fresh_run_name(args.config)})})
    check_inputs(config)
    public, secret = split_secrets(config.model_dump(mode="json"))
    print(f"rlflow: run '{config.run.name}' -> {config.run.root.rstrip('/')}/{config.run.name}", flush=True)

    from rlflow.flows.breach import COMMAND_ENV, shown_command
    from rlflow.flows.rlhf import SECRETS_ENV, format_table, rlhf_flow

    hide_tracebacks_of_user_errors()
    os.environ[SECRETS_ENV] = json.dumps(secret)
    os.environ[COMMAND_ENV] = shown_command(args.config, args.overrides)  # a breach's "continue with" command
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
    except RunHalted as exc:  # a guard stopped the run at a checkpoint: the message says how to continue
        print(f"rlflow: {' '.join(str(exc).splitlines())}", file=sys.stderr)
        return RunHalted.exit_code
    except RlflowError as exc:
        message = " ".join(str(exc).splitlines())  # one line, even if a value quoted in it had a line break
        print(f"rlflow: error: {message}", file=sys.stderr)
        return 2
    except StagePreempted as exc:
        print(f"rlflow: {exc}", file=sys.stderr)
        return StagePreempted.exit_code
    except KeyboardInterrupt:
        print("rlflow: interrupted; run the same command again to continue from the last checkpoint", file=sys.stderr)
        return 130


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
