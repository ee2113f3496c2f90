"""The human-labelling files: what `rlflow label import` accepts, refuses (file:line and how to
fix it) and where it puts the pairs. The export and the triggered round run in
tests/scenarios/test_operate.py."""

import csv
import json

import pytest
import yaml

from conftest import small_config_tree
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.engine.errors import ConfigError, DataError
from rlflow.engine.config.secrets import redact
from rlflow.flows.cli.main import main
from rlflow.flows.cli.labels import COLUMNS, import_labels, pair_id, read_labelled

CHAT = [{"role": "user", "content": "tell me about the sea ."}]


def rows(choices, run="r1", round_index=0):
    out = []
    for i, choice in enumerate(choices):
        prompt = CHAT if i == 0 else f"prompt {i}"
        a, b = f"answer a{i}", f"answer b{i}"
        out.append(dict(id=pair_id(prompt, a, b), run=run, round=round_index, prompt=prompt, answer_a=a, answer_b=b, choice=choice))
    return out


def write_csv(path, table):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in table:
            writer.writerow(row | {"prompt": row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])})
    return path


def write_jsonl(path, table):
    path.write_text("".join(json.dumps(r) + "\n" for r in table))
    return path


@pytest.mark.parametrize("writer", [write_csv, write_jsonl], ids=["csv", "jsonl"])
def test_choices_become_chosen_and_rejected(tmp_path, writer):
    path = writer(tmp_path / f"l.{'csv' if writer is write_csv else 'jsonl'}", rows(["A", "b", "tie", "", "2"]))
    labelled = read_labelled(path)
    assert (labelled.run, labelled.round_index, labelled.ties) == ("r1", 0, 2)
    assert labelled.pairs == [
        {"prompt": CHAT, "chosen": "answer a0", "rejected": "answer b0"},  # a chat prompt survives the CSV cell
        {"prompt": "prompt 1", "chosen": "answer b1", "rejected": "answer a1"},
        {"prompt": "prompt 4", "chosen": "answer b4", "rejected": "answer a4"},
    ]


def write_text(path, text):
    path.write_text(text)
    return path


def bad_cases(tmp_path):
    ok = rows(["A", "B", "A"])
    return {
        "bad choice": (write_csv(tmp_path / "c.csv", ok[:1] + [ok[1] | {"choice": "maybe"}]), "c.csv:3: choice 'maybe'"),
        "missing column": (write_text(tmp_path / "m.csv", "prompt,answer_a,answer_b\np,a,b\n"), "m.csv:1: missing column(s) choice"),
        "empty answer": (write_jsonl(tmp_path / "e.jsonl", [ok[0], ok[1] | {"answer_b": ""}]), "e.jsonl:2: 'answer_b' is missing"),
        "not json": (write_text(tmp_path / "j.jsonl", json.dumps(ok[0]) + "\n{oops\n"), "j.jsonl:2: not valid JSON"),
        "duplicate": (write_jsonl(tmp_path / "d.jsonl", [ok[0], ok[1], ok[0]]), "d.jsonl:3: id"),
        "two rounds": (write_jsonl(tmp_path / "t.jsonl", [ok[0], rows(["A", "A"], round_index=1)[1]]), "the same 'run' and 'round'"),
        "nothing labelled": (write_jsonl(tmp_path / "n.jsonl", rows(["", "tie"])), "no row has a choice"),
        "wrong type": (write_text(tmp_path / "x.txt", "a,b"), "expected a .jsonl or .csv file"),
    }


@pytest.mark.parametrize(
    "case", ["bad choice", "missing column", "empty answer", "not json", "duplicate", "two rounds", "nothing labelled", "wrong type"]
)
def test_bad_rows_are_named_by_file_and_line(tmp_path, case):
    path, expected = bad_cases(tmp_path)[case]
    with pytest.raises(DataError) as info:
        read_labelled(path)
    assert expected in str(info.value)


def make_run(root, small_assets, inbox):
    tree = small_config_tree(small_assets, root, label={"human_inbox": inbox}, data={"storage_options": {"anon": False}})
    tree["run"]["name"] = "r1"
    (root / "r1").mkdir(parents=True)
    (root / "r1" / "config.yaml").write_text(yaml.safe_dump(redact(tree)))  # as the flow writes it


def test_import_puts_pairs_in_the_inbox_and_refuses_what_would_be_lost(tmp_path, small_assets, capsys):
    root, inbox = tmp_path / "runs", tmp_path / "inbox"
    make_run(root, small_assets, str(inbox))
    labelled = write_csv(tmp_path / "l.csv", rows(["A", "B", ""]))
    assert main(["label", "import", str(labelled), "--root", str(root)]) == 0
    target = inbox / "r1" / "round_0.jsonl"
    assert [json.loads(line)["chosen"] for line in target.read_text().splitlines()] == ["answer a0", "answer b1"]
    assert "2 labelled pairs (1 ties or unlabelled skipped)" in capsys.readouterr().out
    assert [p.name for p in target.parent.iterdir()] == ["round_0.jsonl"]  # no temporary file left
    # Importing again would silently replace what a trigger may already have used.
    assert main(["label", "import", str(labelled), "--root", str(root)]) == 2
    assert "already exists; pass --replace" in capsys.readouterr().err
    write_csv(labelled, rows(["B", "B", "B"]))
    assert main(["label", "import", str(labelled), "--root", str(root), "--replace"]) == 0
    assert len(target.read_text().splitlines()) == 3
    # Once round 1 has trained its reward model, round 0's labels can no longer reach it.
    store = CheckpointStore(stage_prefix(str(root), "r1", 1, "rm"))
    with store.writer(1) as w:
        w.write_bytes("x", b"x")
    with pytest.raises(ConfigError, match="round 1 of run 'r1' already trained its reward model"):
        import_labels(labelled, str(root), replace=True)


def test_import_without_an_inbox_says_which_key_to_set(tmp_path, small_assets):
    root = tmp_path / "runs"
    tree = small_config_tree(small_assets, root)
    tree["run"]["name"] = "r1"
    (root / "r1").mkdir(parents=True)
    (root / "r1" / "config.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match="has no label.human_inbox"):
        import_labels(write_jsonl(tmp_path / "l.jsonl", rows(["A"])), str(root), replace=False)
    with pytest.raises(ConfigError, match="no run 'r2'"):
        import_labels(write_jsonl(tmp_path / "l2.jsonl", rows(["A"], run="r2")), str(root), replace=False)
