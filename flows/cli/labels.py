"""The human labelling round trip.

`rlflow label export RUN --round N` writes round N's candidate pairs for raters (JSONL and CSV:
id, prompt, answer_a, answer_b and an empty `choice`); `rlflow label import FILE` validates a
labelled file and writes its pairs to `<label.human_inbox>/<run>/round_<N>.jsonl`, where the
label-inbox watcher sees it and starts the next round, whose reward model trains on them.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from rlflow.engine.storage.checkpoint import CheckpointStore, model_location, stage_prefix
from rlflow.engine.config.schema import Config
from rlflow.engine.errors import ConfigError, DataError
from rlflow.flows.plan import load_run_config
from rlflow.flows.wiring import final_stage

COLUMNS = ("id", "run", "round", "prompt", "answer_a", "answer_b", "choice")
CHOICES = {"a": "A", "1": "A", "b": "B", "2": "B", "tie": None, "": None}


def round_policy(config: Config, round_index: int) -> str:
    """The local model directory of round `round_index`'s final (RL or DPO) policy."""
    store = CheckpointStore(
        stage_prefix(config.run.root, config.run.name, round_index, final_stage(config)), config.run.storage_options
    )
    final = store.final()
    if final is None:
        raise ConfigError(
            f"round {round_index} of run '{config.run.name}' has no final policy yet ({store.url});"
            " run that round first (`rlflow status` shows where the run stands)"
        )
    return model_location(store.step_url(final["step"]), config.run.storage_options)


def pair_id(prompt: Any, a: str, b: str) -> str:
    return hashlib.sha256(json.dumps([prompt, a, b]).encode()).hexdigest()[:16]


def export_candidates(root: str, run_name: str, round_index: int, out_dir: Path, n: int | None) -> list[Path]:
    """Write `<run>-round<N>-candidates.jsonl` and `.csv` to `out_dir`; returns both paths."""
    from rlflow.engine.stages.inputs import ModelLoading
    from rlflow.engine.stages.label import PromptData, sample_answer_pairs

    config = load_run_config(root, run_name)
    triples = sample_answer_pairs(
        round_policy(config, round_index),
        ModelLoading.for_stage(config.model, "label"),
        PromptData.of(config.data),
        config.sampling,
        n or config.label.prompts_per_round,
        config.run.seed,
        round_index,
    )
    rows = [
        dict(
            id=pair_id(rec.prompt, a, b),
            run=run_name,
            round=round_index,
            prompt=rec.prompt,
            answer_a=a,
            answer_b=b,
            choice="",
        )
        for rec, a, b in triples
        if a.strip() and b.strip() and a != b  # identical answers give raters nothing to choose
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{run_name}-round{round_index}-candidates"
    jsonl, table = stem.with_suffix(".jsonl"), stem.with_suffix(".csv")
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with open(table, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:  # a chat prompt (a list of turns) is one JSON cell
            writer.writerow(
                row | {"prompt": row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])}
            )
    return [jsonl, table]


@dataclass(frozen=True)
class LabelledFile:
    run: str
    round_index: int
    pairs: list[dict[str, Any]]  # prompt, chosen, rejected
    ties: int  # rows marked tie or left empty: no preference, not imported


def _rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of a .jsonl or .csv file."""
    text = path.read_text(encoding="utf-8-sig")  # spreadsheets often save a BOM
    if path.suffix == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        missing = [c for c in ("prompt", "answer_a", "answer_b", "choice") if c not in (reader.fieldnames or [])]
        if missing:
            raise DataError(
                f"{path}:1: missing column(s) {', '.join(missing)}; export a file with `rlflow label export`"
            )
        return [(reader.line_num, dict(row)) for row in reader]
    if path.suffix != ".jsonl":
        raise DataError(f"{path}: expected a .jsonl or .csv file from `rlflow label export`")
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}); each line must be one object") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
        rows.append((lineno, row))
    return rows


def read_labelled(path: Path) -> LabelledFile:
    """Validate a labelled export; every problem names the file, line and column."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    pairs, ties, seen, origin = [], 0, set(), set()
    for lineno, row in _rows(path):
        where = f"{path}:{lineno}"
        for key in ("prompt", "answer_a", "answer_b"):
            if not isinstance(row.get(key), (str, list)) or not row.get(key):
                raise DataError(f"{where}: '{key}' is missing or empty; keep the exported columns as they are")
        raw = str(row.get("choice") if row.get("choice") is not None else "").strip().lower()
        if raw not in CHOICES:
            raise DataError(f"{where}: choice {row.get('choice')!r} must be A, B, tie or empty (unlabelled)")
        prompt = row["prompt"]
        if isinstance(prompt, str) and prompt.startswith("[{"):
            prompt = json.loads(prompt)  # a chat prompt written as JSON in a CSV cell
        row_id = row.get("id") or pair_id(prompt, row["answer_a"], row["answer_b"])
        if row_id in seen:
            raise DataError(f"{where}: id {row_id} appears twice; remove the duplicate row")
        seen.add(row_id)
        origin.add((str(row.get("run", "")), str(row.get("round", ""))))
        choice = CHOICES[raw]
        if choice is None:
            ties += 1
            continue
        a, b = row["answer_a"], row["answer_b"]
        chosen, rejected = (a, b) if choice == "A" else (b, a)
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    if len(origin) != 1 or not all(next(iter(origin))):
        raise DataError(f"{path}: rows must all carry the same 'run' and 'round' (one exported file per round)")
    run, round_text = next(iter(origin))
    if not pairs:
        raise DataError(f"{path}: no row has a choice (A or B); label some rows first")
    return LabelledFile(run, int(round_text), pairs, ties)


def import_labels(path: Path, root: str, replace: bool) -> str:
    """Put a labelled file's pairs where the next round (and the watcher) find them; its URL."""
    labelled = read_labelled(path)
    config = load_run_config(root, labelled.run)
    inbox = config.label.human_inbox
    if inbox is None:
        raise ConfigError(
            f"run '{labelled.run}' has no label.human_inbox: set it in the run's config (an fsspec prefix,"
            " e.g. runs/label-inbox) and run the next round with it"
        )
    following = CheckpointStore(
        stage_prefix(config.run.root, config.run.name, labelled.round_index + 1, "rm"), config.run.storage_options
    )
    if following.latest() is not None:
        raise ConfigError(
            f"round {labelled.round_index + 1} of run '{labelled.run}' already trained its reward model; labels of"
            f" round {labelled.round_index} can no longer change it"
        )
    url = f"{inbox.rstrip('/')}/{labelled.run}/round_{labelled.round_index}.jsonl"
    fs, target = fsspec.core.url_to_fs(url, **config.data.storage_options)
    if fs.exists(target) and not replace:
        raise ConfigError(f"{url} already exists; pass --replace to overwrite it")
    body = "".join(json.dumps(p) + "\n" for p in labelled.pairs).encode()
    fs.makedirs(fs._parent(target), exist_ok=True)
    tmp = f"{target}.tmp"  # the watcher only matches round_<n>.jsonl: it never sees a half file
    fs.pipe_file(tmp, body)
    fs.mv(tmp, target)
    print(f"{len(labelled.pairs)} labelled pairs ({labelled.ties} ties or unlabelled skipped) -> {url}")
    return url


def command_label(args: argparse.Namespace) -> int:
    if args.label_command == "export":
        for path in export_candidates(args.root, args.run, args.round, Path(args.out), args.n):
            print(path)
    else:
        import_labels(Path(args.file), args.root, args.replace)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("label", help="human labels: export a round's candidate pairs, import the labelled file")
    inner = p.add_subparsers(dest="label_command", required=True)
    exp = inner.add_parser("export", help="write round N's candidate pairs (JSONL and CSV) for raters")
    exp.add_argument("run", help="run.name")
    exp.add_argument("--round", type=int, required=True)
    exp.add_argument("--out", default="labels", help="output folder (default: labels)")
    exp.add_argument("--n", type=int, help="number of prompts (default: label.prompts_per_round)")
    exp.add_argument("--root", default="runs")
    imp = inner.add_parser("import", help="validate a labelled file and put it where the next round sees it")
    imp.add_argument("file")
    imp.add_argument("--root", default="runs")
    imp.add_argument("--replace", action="store_true", help="overwrite labels already imported for that round")
    for parser in (exp, imp):
        parser.set_defaults(handler=command_label)
