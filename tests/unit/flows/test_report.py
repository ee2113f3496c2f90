"""The HTML report of a run, built from a real local MLflow store (sqlite under tmp_path) and the
run's evaluation checkpoints: its title, per-round table, inlined figure and sample responses."""

import base64
import re

import pytest

from conftest import small_config_tree
from helpers.mlflow_runs import eval_metrics, record_run, tracker_at
from rlflow.engine.config.schema import build_config
from rlflow.engine.stages.round_eval import RESULTS_FILE
from rlflow.engine.storage.checkpoint import CheckpointStore, stage_prefix
from rlflow.flows.compare import RoundRecord
from rlflow.flows.report import build_report, render_report, sample_rows

ROUNDS = {
    0: {
        "rm": (4.0, {"rm/accuracy": [(0, 0.625)]}),
        "rl": (10.0, {"perf/throughput": [(1, 50.0), (2, 70.0)], "critic/score/mean": [(1, 0.2), (2, 0.5)]}),
        "eval": (6.0, eval_metrics(before=0.125, after=0.375, rm_score=1.5, kl=0.25)),
    },
    1: {"eval": (2.5, eval_metrics(before=0.375, after=0.5, rm_score=2.0, kl=0.75))},
}


def samples(n, tag):
    return [
        {"prompt": f"{tag} prompt {i} <b>", "response": f"answer {i} & more", "gold_score": i / 8, "rm_score": -i / 4}
        for i in range(n)
    ]


def write_eval_results(cfg, round_index, rows):
    """The round's eval stage output as the stage commits it: results.json in its final step."""
    store = CheckpointStore(stage_prefix(cfg.run.root, cfg.run.name, round_index, "eval"))
    with store.writer(1) as w:
        w.write_json(RESULTS_FILE, {"before": {"samples": []}, "after": {"samples": rows}})
    store.mark_final(1)


@pytest.fixture(scope="module")
def run(small_assets, tmp_path_factory):
    """(the run's config, a client of its MLflow store): two rounds recorded, round 0's evaluation
    samples committed; round 1 has no final eval step. Read only."""
    tmp_path = tmp_path_factory.mktemp("report-run")
    tracker = tracker_at(tmp_path, "reports")
    cfg = build_config(
        small_config_tree(
            small_assets, tmp_path / "runs", run={"name": "rep", "rounds": 2}, tracking={"experiment": "reports"}
        ),
        "t",
    )
    record_run(tracker, "rep", ROUNDS)
    write_eval_results(cfg, 0, samples(15, "r0"))
    return cfg, tracker.client


def test_sample_rows_are_the_first_dozen_of_the_final_evaluation(run):
    cfg, _ = run
    rows = sample_rows(cfg, 0)
    assert rows == samples(15, "r0")[:12]
    assert sample_rows(cfg, 0, n=3) == samples(3, "r0")
    assert sample_rows(cfg, 1) == []  # no final eval step


def test_the_report_shows_the_run_its_rounds_numbers_and_samples(run):
    cfg, client = run
    report, png = build_report(client, cfg)
    assert png.startswith(b"\x89PNG")
    assert "<title>rlflow run rep</title>" in report and "<h1>rlflow run <code>rep</code></h1>" in report
    assert "<div class=meta>2 round(s); numbers read back from MLflow</div>" in report
    table = re.search(r"<table id=rounds>(.*?)</table>", report).group(1)
    header = re.findall(r"<th>(.*?)</th>", table)
    assert header == ["round", "gold_before", "gold_after", "rm_score", "kl", "rm_acc", "rl_tok_s", "seconds"]
    rows = [re.findall(r"<td class=n>(.*?)</td>", row) for row in re.findall(r"<tr><td class=n>.*?</tr>", table)]
    assert rows == [
        ["0", "0.1250", "0.3750", "1.5000", "0.2500", "0.6250", "60.0", "20.0"],
        ["1", "0.3750", "0.5000", "2.0000", "0.7500", "-", "-", "2.5"],
    ]
    assert f"src='data:image/png;base64,{base64.b64encode(png).decode()}'" in report  # the figure inlined
    assert "<h2>Round 0: sample responses of the final policy</h2>" in report
    assert "<h2>Round 1: sample responses of the final policy</h2>" in report
    assert report.count("<td class=r>r0 prompt ") == 12
    # prompts and responses are escaped, scores formatted like the table's cells
    assert "<td class=r>r0 prompt 2 &lt;b&gt;</td><td class=r>answer 2 &amp; more</td>" in report
    assert "<td class=n>0.2500</td><td class=n>-0.5000</td></tr>" in report
    assert "<b>" not in report and report.endswith("</body></html>")


def test_a_run_name_and_a_missing_score_are_escaped_and_dashed():
    records = [RoundRecord("x", 0, {"gold_after": 0.5})]
    rows = {0: [{"prompt": "p", "response": "r", "gold_score": None}]}
    report = render_report("<a&b>", records, b"png", rows)
    assert "<title>rlflow run &lt;a&amp;b&gt;</title>" in report and "<a&b>" not in report
    assert "<tr><td class=n>0</td><td class=n>-</td><td class=n>0.5000</td>" in report
    assert "<td class=n>-</td><td class=n>-</td></tr>" in report  # no gold and no RM score
    assert f"base64,{base64.b64encode(b'png').decode()}'" in report
    assert "1 round(s)" in report


def test_a_chat_prompt_shows_its_turns_and_an_episode_its_transcript():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "2+2?"}]
    rows = {0: [
        {"prompt": chat, "response": "4", "gold_score": 1.0},
        {"prompt": "p", "response": "17", "transcript": "<tool_call>{}</tool_call>\n<tool>17</tool>\n17"},
    ]}
    report = render_report("x", [RoundRecord("x", 0, {})], b"png", rows)
    assert "<td class=r>user: hi\nassistant: yo\nuser: 2+2?</td><td class=r>4</td>" in report
    assert "<td class=r>&lt;tool_call&gt;{}&lt;/tool_call&gt;\n&lt;tool&gt;17&lt;/tool&gt;\n17</td>" in report
