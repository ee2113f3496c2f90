"""`rlflow compare` on runs recorded in a real local MLflow store (sqlite under tmp_path): the rounds
read back from the runs' children, the table's numbers, the cost column, the figure, and the
messages when a run or experiment is not there."""

import argparse

import pytest
import yaml

from helpers.mlflow_runs import eval_metrics, record_run, tracker_at
from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.hardware import load_price_book
from rlflow.flows.compare import (
    PRICES,
    collect,
    command_compare,
    format_cell,
    format_compare_table,
    format_paired,
    load_gold_by_prompt,
    plot_curves,
    price_rounds,
)
from rlflow.engine.stages.round_eval import BY_PROMPT_TABLE

PPO = {
    "perf/throughput": [(1, 100.0), (2, 200.0), (3, 300.0)],  # the column is the mean: 200
    "critic/score/mean": [(1, 0.1), (2, 0.3), (3, 0.35)],
    "actor/kl": [(1, 0.01), (2, 0.02), (3, 0.04)],
    "response_length/mean": [(1, 10.0), (2, 12.0), (3, 11.0)],
}
ALPHA = {
    0: {
        "rm": (10.0, {"rm/accuracy": [(0, 0.6), (5, 0.7)]}),  # the latest value: 0.7
        "rl": (30.0, PPO),
        "eval": (20.0, eval_metrics(before=0.1, after=0.4, rm_score=2.5, kl=0.05)),
    },
    1: {"eval": (5.0, eval_metrics(before=0.4, after=0.45, rm_score=3.0, kl=0.125))},
}
BETA = {0: {"eval": (8.0, eval_metrics(before=0.2, after=0.3, rm_score=1.0, kl=0.5))}}


# round 0's gold per held-out prompt, as the eval stage logs it: beta - alpha = [1, 1, 0, -1]
ALPHA_BY_PROMPT = [("p1", 0.0), ("p2", 0.0), ("p3", 1.0), ("p4", 1.0)]
BETA_BY_PROMPT = [("p1", 1.0), ("p2", 1.0), ("p3", 1.0), ("p4", 0.0)]


def log_by_prompt(tracker, run_name, scores):
    """The eval stage's per-prompt table on run_name's round-0 eval child."""
    _, records = collect(tracker.client, tracker.experiment_name, [run_name])
    rows = [{"prompt": p, "gold_before": 0.0, "gold_after": g} for p, g in scores]
    tracker.sink(records[0].children["eval"]).log_table(BY_PROMPT_TABLE, rows)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tracker and the parent run ids of runs alpha and beta (read only, but for compare's figure
    artifact under compare/); round 0 of each has its per-prompt gold table."""
    tracker = tracker_at(tmp_path_factory.mktemp("mlflow"))
    parents = {"alpha": record_run(tracker, "alpha", ALPHA), "beta": record_run(tracker, "beta", BETA)}
    log_by_prompt(tracker, "alpha", ALPHA_BY_PROMPT)
    log_by_prompt(tracker, "beta", BETA_BY_PROMPT)
    return tracker, parents


def price_file(tmp_path, price: float) -> str:
    """configs/prices.yaml's cpu entry at `price` EUR an hour."""
    tree = yaml.safe_load(open(PRICES))
    path = tmp_path / "prices.yaml"
    path.write_text(
        yaml.safe_dump({"currency": "EUR", "devices": {"cpu": tree["devices"]["cpu"] | {"price_per_gpu_hour": price}}})
    )
    return str(path)


def test_collect_reads_each_round_of_each_run_from_its_children(store):
    tracker, parents = store
    found, records = collect(tracker.client, "rlflow", ["alpha", "beta"])
    assert found == parents
    assert [(r.run, r.round_index) for r in records] == [("alpha", 0), ("alpha", 1), ("beta", 0)]
    first = records[0]
    assert set(first.children) == {"rm", "rl", "eval"}
    assert first.values == pytest.approx(
        {
            "gold_before": 0.1,
            "gold_after": 0.4,
            "rm_score": 2.5,
            "kl": 0.05,
            "rm_acc": 0.7,
            "rl_tok_s": 200.0,
            "seconds": 60.0,  # 10 + 30 + 20: the round's stages' wall seconds
        }
    )
    assert first.curves == {
        "critic/score/mean": [(1, 0.1), (2, 0.3), (3, 0.35)],
        "actor/kl": [(1, 0.01), (2, 0.02), (3, 0.04)],
        "response_length/mean": [(1, 10.0), (2, 12.0), (3, 11.0)],
    }
    second = records[1]
    assert "rm_acc" not in second.values and "rl_tok_s" not in second.values and second.curves == {}
    assert second.values["gold_after"] == 0.45 and second.values["seconds"] == pytest.approx(5.0)


def test_the_cost_is_seconds_times_devices_times_the_hourly_price(store, tmp_path):
    tracker, _ = store
    parents, records = collect(tracker.client, "rlflow", ["alpha", "beta"])
    price_rounds(tracker.client, parents, records, load_price_book(price_file(tmp_path, 3.6)))
    # no resources.gpu_type: one CPU at 3.6 EUR/h = 0.001 EUR a second
    assert [r.values["cost"] for r in records] == pytest.approx([0.06, 0.005, 0.008])


def test_a_gpu_run_is_priced_at_its_devices_and_an_unpriced_device_is_named(tmp_path):
    tracker = tracker_at(tmp_path, "gpus")
    gpus = {"resources": {"gpu_type": "a100-40g", "nproc_per_node": 8, "nnodes": 2}}
    record_run(tracker, "big", {0: {"eval": (36.0, eval_metrics(0.1, 0.2, 1.0, 0.1))}}, {"run": {"name": "big"}} | gpus)
    book = yaml.safe_load(open(PRICES))
    hourly = float(book["devices"]["a100-40g"]["price_per_gpu_hour"])
    parents, records = collect(tracker.client, "gpus", ["big"])
    price_rounds(tracker.client, parents, records, load_price_book(PRICES))
    assert records[0].values["cost"] == pytest.approx(36.0 * 16 * hourly / 3600)  # 16 GPUs for 36 s
    unpriced = {"resources": {"gpu_type": "tpu-v9", "nproc_per_node": 1, "nnodes": 1}}
    odd_round = {0: {"eval": (1.0, eval_metrics(0.1, 0.2, 1.0, 0.1))}}
    record_run(tracker, "odd", odd_round, {"run": {"name": "odd"}} | unpriced)
    parents, records = collect(tracker.client, "gpus", ["odd"])
    with pytest.raises(ConfigError, match=r"run 'odd' ran on resources.gpu_type='tpu-v9', which .* does not price"):
        price_rounds(tracker.client, parents, records, load_price_book(PRICES))


def test_the_table_has_a_row_per_round_and_a_dash_for_what_a_round_lacks(store, tmp_path):
    tracker, _ = store
    parents, records = collect(tracker.client, "rlflow", ["alpha", "beta"])
    price_rounds(tracker.client, parents, records, load_price_book(price_file(tmp_path, 3.6)))
    lines = format_compare_table(records, "EUR").splitlines()
    assert lines[0].split() == [
        "run", "round", "gold_before", "gold_after", "rm_score", "kl", "rm_acc", "rl_tok_s", "seconds", "cost_EUR",
    ]  # fmt: skip
    assert lines[1].split() == ["alpha", "0", "0.1000", "0.4000", "2.5000", "0.0500", "0.7000", "200.0", "60.0", "0.06"]
    assert lines[2].split() == ["alpha", "1", "0.4000", "0.4500", "3.0000", "0.1250", "-", "-", "5.0", "0.005"]
    assert lines[3].split() == ["beta", "0", "0.2000", "0.3000", "1.0000", "0.5000", "-", "-", "8.0", "0.008"]
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1  # fixed-width columns


def test_a_cell_is_a_dash_when_missing_and_rounded_by_its_column():
    assert format_cell(None) == "-" and format_cell(float("nan")) == "-"
    assert format_cell(0.123456) == "0.1235" and format_cell(7) == "7"
    assert format_cell(1234.56, "seconds") == "1234.6" and format_cell(99.04, "rl_tok_s") == "99.0"
    assert format_cell(0.000123456, "cost") == "0.0001235"


def test_the_figure_is_a_png_of_the_ppo_curves(store):
    tracker, _ = store
    _, records = collect(tracker.client, "rlflow", ["alpha"])
    png = plot_curves(records)
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert plot_curves(records[1:]).startswith(b"\x89PNG")  # a round without PPO curves: empty panels


def test_compare_prints_the_table_and_saves_and_logs_the_figure(store, tmp_path, capsys):
    tracker, parents = store
    out = tmp_path / "figs" / "cmp.png"
    args = argparse.Namespace(
        runs=["alpha", "beta"],
        out=str(out),
        tracking_uri=tracker.tracking_uri,
        experiment="rlflow",
        root=str(tmp_path / "runs"),
        prices=price_file(tmp_path, 3.6),
    )
    assert command_compare(args) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[-1] == "cost_EUR" and printed[1].split()[:2] == ["alpha", "0"]
    assert printed[4].split() == ["gold_after", "paired", "with", "alpha", "diff", "stderr", "prompts"]
    assert printed[5].split() == ["beta", "r0", "+0.2500", "0.4787", "4"]
    assert (
        len(printed) == 7
        and printed[6] == f"figure: {out} (also the MLflow artifact compare/cmp.png of each run's parent run)"
    )
    assert out.read_bytes().startswith(b"\x89PNG")
    for parent_id in parents.values():
        assert [f.path for f in tracker.client.list_artifacts(parent_id, "compare")] == ["compare/cmp.png"]


def test_a_run_or_experiment_that_is_not_there_is_named(store):
    tracker, _ = store
    with pytest.raises(ConfigError) as err:
        collect(tracker.client, "rlflow", ["alpha", "gamma"])
    assert str(err.value).startswith(f"no run named 'gamma' in MLflow experiment 'rlflow' at {tracker.tracking_uri}")
    assert "MLFLOW_TRACKING_URI (or --tracking-uri)" in str(err.value)
    with pytest.raises(ConfigError, match="^MLflow experiment 'other' not found at sqlite:///"):
        collect(tracker.client, "other", ["alpha"])
    with pytest.raises(ConfigError, match="cannot contain a quote"):
        collect(tracker.client, "rlflow", ["al'pha"])


def test_a_later_run_is_paired_with_the_first_per_prompt_on_the_same_round(store):
    tracker, _ = store
    _, records = collect(tracker.client, "rlflow", ["alpha", "beta"])
    by_prompt = {(r.run, r.round_index): load_gold_by_prompt(tracker.client, r) for r in records}
    assert by_prompt[("alpha", 0)] == (["p1", "p2", "p3", "p4"], [0.0, 0.0, 1.0, 1.0])
    assert by_prompt[("alpha", 1)] is None  # its eval child has no table
    # differences [1, 1, 0, -1]: mean 0.25, sample variance 2.75 / 3, stderr sqrt(0.9167 / 4) = 0.4787
    assert format_paired(records, by_prompt)[1].split() == ["beta", "r0", "+0.2500", "0.4787", "4"]
    assert format_paired(records[:2], by_prompt) == []  # one run: nothing to pair
    without = by_prompt | {("beta", 0): None}
    assert "no per-prompt scores" in format_paired(records, without)[1]
    shuffled = by_prompt | {("beta", 0): (["p2", "p1", "p3", "p4"], [1.0, 1.0, 1.0, 0.0])}
    assert format_paired(records, shuffled)[1].endswith("other held-out prompts than alpha's: not paired")
