"""`rlflow data gym NAME --size N --seed S [--config k=v ...] --out DIR`: prompt files of a
reasoning-gym task (train and held-out, from disjoint seeds) for a verifier reward."""

from __future__ import annotations

import argparse
from typing import Any

from rlflow.engine.errors import ConfigError


def parse_config_items(items: list[str]) -> dict[str, Any]:
    """`k=v` items -> {k: v}, each value read as YAML (numbers, booleans, lists)."""
    import yaml

    config: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--config {item!r} must look like key=value, e.g. --config max_digits=2")
        try:
            config[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"--config {item!r}: the value is not valid YAML; quote it") from None
    return config


def command_gym(args: argparse.Namespace) -> int:
    from rlflow.engine.tasksets.gym import write_gym_dataset

    config = parse_config_items(args.config)
    written = write_gym_dataset(
        args.name, args.out, args.size, args.eval_size, args.seed, config, args.extract, args.instruction, args.tool,
        args.flawed,
    )
    print(
        f"gym {args.name} {config or ''}: {written['train']} training and {written['heldout']} held-out prompts"
        f" (seeds {args.seed} and {args.seed}+10**6, held-out questions not in training) -> {args.out}/"
        " {prompts,eval_prompts,sft,sft_eval}.jsonl"
    )
    return 0


def add_parser(sub: Any) -> None:
    data = sub.add_parser("data", help="write task data files")
    kinds = data.add_subparsers(dest="kind", required=True)
    p = kinds.add_parser("gym", help="prompts and verifier columns from a reasoning-gym dataset")
    p.add_argument("name", help="a reasoning-gym dataset, e.g. basic_arithmetic, chain_sum, leg_counting")
    p.add_argument("--size", type=int, required=True, help="training prompts")
    p.add_argument("--eval-size", type=int, default=256, help="held-out prompts (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", action="append", default=[], metavar="K=V", help="dataset option, repeatable")
    p.add_argument("--extract", choices=("answer_tag", "last_number", "full"), default="answer_tag",
                   help="the answer format the prompts ask for and the verifier reads (default answer_tag)")
    p.add_argument("--instruction", help="the answer-format sentence after each question (default: per --extract)")
    p.add_argument("--tool", choices=("python",),
                   help="SFT demonstrations call this tool on the question's expression, then answer")
    p.add_argument("--flawed", type=float, default=0.0, metavar="SHARE",
                   help="share of --tool demonstrations from a sloppy annotator: 3/5 guess, 2/5 mistype (default 0)")
    p.add_argument("--out", required=True, help="output folder")
    p.set_defaults(handler=command_gym)
