"""`rlflow promote RUN --round N --reason TEXT`: an operator promotes a round the gates rejected.

The override is recorded in the run (promotion_overrides.json, honoured whenever the round is
decided again), on the registered version (`rlflow.promotion.override` = "<who>: <why>", next to
the failed gates' tags) and in summary.json; the `champion` alias moves to the round's version, and
a continued run's next round starts from it. Only the last finished round can be promoted by hand:
the rounds after an earlier one already started from another policy.
"""

from __future__ import annotations

import argparse
import getpass
import json
from typing import Any

from rlflow.engine.errors import ConfigError
from rlflow.engine.storage.lock import RunLock
from rlflow.flows.plan import load_run_config, read_run_file


def _last_round(config: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The run's summary rows, checked: promotion on, round N decided and the last one."""
    if not config.promotion.enabled:
        raise ConfigError(f"run '{args.run}' runs with promotion.enabled=false: every round is the next one's start")
    summary = read_run_file(args.root, args.run, "summary.json", config.run.storage_options)
    rows = json.loads(summary)["rounds"] if summary else []
    decided = [row["round"] for row in rows if "promotion" in row]
    if args.round not in decided:
        raise ConfigError(
            f"round {args.round} of run '{args.run}' has no promotion decision yet (decided: {decided or 'none'});"
            " see `rlflow status`"
        )
    if args.round != rows[-1]["round"]:
        raise ConfigError(
            f"round {args.round} of run '{args.run}' is not its last round ({rows[-1]['round']}): the rounds after"
            " it already started from another policy. Promote the last round, or start a new run.name from it"
        )
    return rows


def command_promote(args: argparse.Namespace) -> int:
    from rlflow.engine.promotion.gates import GateResult, PromotionDecision, gate_table
    from rlflow.flows.promotion import write_override
    from rlflow.flows.rlhf import write_summary
    from rlflow.tasks.tracking import (
        point_champion_alias,
        record_promotion,
        registered_model_name,
        round_version,
        tracking_client,
    )

    if not args.reason.strip():
        raise ConfigError("--reason must say why the round is promoted by hand (it is recorded with your name)")
    config = load_run_config(args.root, args.run)
    # Not while the run is running: its own decision could move the alias under ours.
    with RunLock(f"{config.run.root.rstrip('/')}/{config.run.name}", config.run.storage_options):
        rows = _last_round(config, args)
        row = rows[-1]
        if row["promotion"]["decision"] == "promoted":
            version = row["promotion"]["champion_version"]
            print(f"round {args.round} of '{args.run}' is already promoted (version {version})")
            return 0
        client = tracking_client(config.tracking.uri, config.run.root)
        name = registered_model_name(config.run.name)
        registered = round_version(client, config.run.name, args.round)
        if registered is None:
            raise ConfigError(f"round {args.round} of run '{args.run}' has no registered version in {name}")
        version = str(registered.version)
        override = write_override(config, args.round, getpass.getuser(), args.reason.strip())
        gates = tuple(GateResult(**g) for g in row["promotion"]["gates"])
        decision = PromotionDecision(True, gates, override)
        record_promotion(client, config.run.name, version, {g.metric: g.reason for g in decision.failed}, override)
        point_champion_alias(client, config.run.name, version)
        row["promotion"] = decision.as_row(version)
        write_summary(config, rows)
    print(gate_table(decision, args.round))
    print(f"round {args.round} of '{args.run}': version {version} of '{name}' is the champion ({override})")
    print(f"continue the run (`rlflow run` with run.name={config.run.name}) to start the next round from it")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("promote", help="promote a round the promotion gates rejected, by hand, with a reason")
    p.add_argument("run", help="run.name")
    p.add_argument("--round", type=int, required=True, help="the run's last finished round")
    p.add_argument("--reason", required=True, help="why (recorded with your user name on the registered version)")
    p.add_argument("--root", default="runs", help="run.root of the run (default: runs)")
    p.set_defaults(handler=command_promote)
