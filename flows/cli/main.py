"""`rlflow` command line: run | status | compare | deploy | label | export | promote | import-model | data | doctor |
config | demo-assets.

Errors the user can fix (config, data, paths) print one line and exit with code 2; inputs are
checked before the Prefect server starts, so a typo costs a second, not a server start.
Continuing a run is `rlflow run` with the same run.name: there is no separate resume command.
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
    """Must run before prefect is imported: its settings are read from the environment.
    Servers that `make up` started here are used unless PREFECT_API_URL / MLFLOW_TRACKING_URI
    name others."""
    from rlflow.flows.servers import ENV_VARS, registered_urls

    for key, value in PREFECT_DEFAULTS.items():
        os.environ.setdefault(key, value)
    for name, url in registered_urls().items():
        os.environ.setdefault(ENV_VARS[name], url)


def fresh_run_name(config_path: str) -> str:
    return f"{Path(config_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}-{pysecrets.token_hex(2)}"


def command_run(args: argparse.Namespace) -> int:
    from rlflow.engine.config.schema import load_config
    from rlflow.engine.config.secrets import split_secrets
    from rlflow.flows.preflight import check_inputs

    config = load_config(args.config, args.overrides)
    if config.run.name is None:
        config = config.model_copy(update={"run": config.run.model_copy(update={"name": fresh_run_name(args.config)})})
    check_inputs(config, writes=not args.dry_run)  # a dry run refuses what the run would refuse, and writes nothing
    if args.dry_run:
        print(dry_run_text(config))
        return 0
    public, secret = split_secrets(config.model_dump(mode="json"))
    print(f"rlflow: run '{config.run.name}' -> {config.run.root.rstrip('/')}/{config.run.name}", flush=True)
    print(f"rlflow: {reporting_to(config)}", flush=True)

    from rlflow.engine.telemetry.progress import QUIET_ENV
    from rlflow.flows.breach import COMMAND_ENV, shown_command
    from rlflow.flows.rlhf import format_table, rlhf_flow
    from rlflow.engine.config.secrets import SECRETS_ENV

    hide_tracebacks_of_user_errors()
    if args.quiet:
        os.environ[QUIET_ENV] = "1"
    os.environ[SECRETS_ENV] = json.dumps(secret)
    os.environ[COMMAND_ENV] = shown_command(args.config, args.overrides)  # a breach's "continue with" command
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if not PREFECT_API_URL.value() and PREFECT_SERVER_EPHEMERAL_ENABLED.value():  # stopped even if we are killed
        from rlflow.flows.temporary_server import start_temporary_server

        start_temporary_server()
    result = rlhf_flow(config=public, source=args.config)
    print(f"\nrun '{result['run']}' finished; final policy: {result['final_policy']}")
    print(format_table(result["rounds"]))
    return 0


def reporting_to(config: Any) -> str:
    from rlflow.engine.config.secrets import shown_url

    prefect = os.environ.get("PREFECT_API_URL")
    mlflow = config.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    prefect = shown_url(prefect) if prefect else "a temporary local Prefect server (`make up` keeps one)"
    return f"Prefect: {prefect}; MLflow: {shown_url(mlflow) if mlflow else 'sqlite under run.root'}"


def dry_run_text(config: Any) -> str:
    """The resolved config (secrets redacted) and what the run will do with each stage; no model loads."""
    from rlflow.engine.config.schema import to_yaml
    from rlflow.flows.plan import format_plan, plan_run

    return (
        f"# resolved config of run '{config.run.name}' (secrets shown as ***)\n{to_yaml(config)}\n"
        f"# plan: {config.run.rounds} round(s): each stage done (skipped), changed (the keys that differ), at a"
        " committed step (continued) or not started\n"
        f"{format_plan(plan_run(config))}\n"
        f"# {reporting_to(config)}"
    )


def command_status(args: argparse.Namespace) -> int:
    """Where a run stands: each planned stage's state, the last logged step, the round summary."""
    from rlflow.flows.plan import format_plan, last_events, load_run_config, plan_run, read_run_file
    from rlflow.flows.preflight import check_run_format
    from rlflow.flows.rlhf import format_table

    check_run_format(args.root, args.run, {})  # an rlflow 0.1 run's config.yaml has keys this rlflow moved
    config = load_run_config(args.root, args.run)
    print(f"run '{args.run}' ({args.root.rstrip('/')}/{args.run}):")
    print(format_plan(plan_run(config)))
    for event in last_events(args.root, args.run):
        print(f"last logged step: round {event['round']} {event['stage']} step {event['step']} at {event['time']}")
    summary = read_run_file(args.root, args.run, "summary.json", {})
    if summary:
        print(format_table(json.loads(summary)["rounds"]))
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
    if args.task == "arith":  # configs/demo_arith.yaml's verifiable-reward task
        from rlflow.engine.tasksets.arith import DEFAULT_DIR, make_arith_assets

        print(make_arith_assets(args.dir or DEFAULT_DIR, seed=args.seed))
        return 0
    if args.task == "tools":  # configs/demo_tools.yaml's tool-use task
        from rlflow.engine.tasksets.calculator import DEFAULT_DIR, make_tools_assets

        print(make_tools_assets(args.dir or DEFAULT_DIR, seed=args.seed))
        return 0
    from rlflow.engine.tasksets.demo import make_demo_assets

    print(make_demo_assets(args.dir or "demo_assets", seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rlflow.flows import compare
    from rlflow.flows.cli import (
        config_keys,
        data,
        deploy,
        doctor,
        estimate,
        export,
        import_model,
        labels,
        probe,
        promote,
    )

    parser = argparse.ArgumentParser(
        prog="rlflow", description="RLHF as a Prefect flow: SFT -> reward model -> PPO rounds."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run, or continue (same run.name), the pipeline of a config")
    run.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    run.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. rl.steps=20 run.name=exp1")
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and the plan; run nothing")
    run.add_argument("--quiet", action="store_true", help="one log line per logged step instead of progress bars")
    run.set_defaults(handler=command_run)
    status = sub.add_parser("status", help="where a run stands: stages done, last step, round summary")
    status.add_argument("run", help="run.name")
    status.add_argument("--root", default="runs", help="run.root of the run (default: runs)")
    status.set_defaults(handler=command_status)
    for module in (compare, deploy, labels, export, promote, import_model, data, doctor, estimate, probe, config_keys):
        module.add_parser(sub)
    assets = sub.add_parser("demo-assets", help="write the demo data, tokenizer and tiny model")
    assets.add_argument(
        "dir", nargs="?", help="default: demo_assets (task demo), demo_assets/arith (arith), demo_assets/tools (tools)"
    )
    assets.add_argument(
        "--task", choices=("demo", "arith", "tools"), default="demo", help="which demo task (default: demo)"
    )
    assets.add_argument("--seed", type=int, default=1234)
    assets.set_defaults(handler=command_demo_assets)
    return parser


def main(argv: list[str] | None = None) -> int:
    configure_prefect_env()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a positional list at the first flag: `run CONFIG --dry-run a.b=c` is meant too.
    if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in e and e[0] != "-" for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
