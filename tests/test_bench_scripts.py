"""bench/ cannot rot unseen. The scripts that drive rlflow's RL step (and two that drive a stage's
worker) run once here on the tiny demo model, started the way their orchestrators start them, and
the test checks that each ran and wrote its result; never how fast. Every other script is imported
and its command line parsed. A script that cannot run here is listed with the reason, and every file
under bench/ must be in exactly one of the lists below: a new script is classified when it lands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

# Run here, once, on the tiny demo model (each a test below).
RUN = {
    "rlflow_ppo_worker.py": "one PPO step and the bare-torch floor beside it, as bench/ppo_vs_trl.py starts it",
    "rlflow_grpo_worker.py": "one GRPO step, as bench/ppo_vs_trl.py --algos grpo starts it",
    "rlflow_off_policy_worker.py": "one step in each of its eight rollout modes, as off_policy_bench.py starts it",
    "engine_bench.py": "its PPO timing (colocated and with an hf rollout server) and one SFT figure, in-process",
    "real_memory.py": "one GRPO and one PPO step of its worker on the tiny model instead of SmolLM2",
    "resume_bench.py": "its smallest size: an SFT worker killed at step 2 and continued",
}
# Imported, and run with --help (argparse exits 0 with its usage): their work needs what is named.
PARSE = {
    "bench_assets.py": "builds SmolLM2's assets too; its tiny-size builders make this test's models",
    "decode_floor.py": "SmolLM2, minutes of decoding",
    "ensemble_spread.py": "a finished run and minutes of reward-model training",
    "gym_survey.py": "SmolLM2 sampling hundreds of reasoning-gym prompts",
    "lora_memory.py": "SmolLM2, one process per mode",
    "multi_turn_bench.py": "minutes of multi-turn decoding",
    "off_policy_bench.py": "the orchestrator: its workers run above; it adds 50m and SmolLM2 sizes",
    "ppo_vs_trl.py": "the orchestrator: TRL (.bench/trl) and SmolLM2; its rlflow workers run above",
    "promotion_noise.py": "a finished run of the demo",
    "vllm_bench.py": "SmolLM2 through three samplers, a vLLM replica among them (minutes)",
    "sampler_mismatch.py": "SmolLM2 through an HF worker and a vLLM replica, each in fp32 and bf16 (minutes)",
}
# Imported only: no command line of their own.
IMPORT = {
    "harness.py": "the orchestrators' shared helpers",
    "grpo_bench.py": "the GRPO half of ppo_vs_trl.py, helpers only",
    "slow_judge.py": "a reward function the off-policy worker loads by name (it runs there)",
    "matmul_backends.py": "no arguments: running it is the minute-long measurement itself",
}
# Not run at all, and why.
EXCEPTIONS = {
    "trl_ppo_worker.py": "imports TRL, which `make bench` installs into .bench/trl only (never the project venv)",
    "trl_grpo_worker.py": "imports TRL, as trl_ppo_worker.py",
    "summaries.py": "records nine whole pipelines (~25 min); only its compare command runs here",
}

TINY = {"batch": 2, "max_new_tokens": 4, "warmup": 0, "updates": 1, "threads": 1, "quiet_s": 0.0}


def test_every_bench_script_is_classified():
    lists = (RUN, PARSE, IMPORT, EXCEPTIONS)
    named = [name for entries in lists for name in entries]
    assert len(named) == len(set(named)), "a script is in two lists"
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(named)


@pytest.fixture
def bench_modules(monkeypatch):
    """bench/ importable by its scripts' own names (they import one another as top-level modules),
    and those names gone from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(BENCH))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", None) and Path(sys.modules[name].__file__).parent == BENCH:
            del sys.modules[name]


@pytest.fixture(scope="module")
def assets(small_assets, tmp_path_factory):
    """The layout bench_assets.build() writes, for the tiny size only: the demo model as policy, a
    reward model with a seeded head, the bench tokenizer whose EOS no response can reach."""
    sys.path.insert(0, str(BENCH))
    try:
        import bench_assets
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("bench_assets", None)
    root = tmp_path_factory.mktemp("bench-assets")
    tokenizer = bench_assets.bench_tokenizer(small_assets / "tiny-model")
    policy, rm = root / "tiny" / "policy", root / "tiny" / "rm"
    bench_assets.build_policy("tiny", small_assets / "tiny-model", tokenizer, policy)
    bench_assets.build_reward_model(policy, tokenizer, rm, seed=100)
    prompts = root / "prompts.jsonl"
    prompts.write_text((small_assets / "data" / "prompts.jsonl").read_text())
    return {"prompts": str(prompts), "tiny": {"policy": str(policy), "rm": str(rm)}}


def run_worker(script: str, work: dict) -> dict:
    """The worker as harness.run_worker starts it (one process, the workload as its argument), on one
    thread; its one BENCH_JSON line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(BENCH / script), json.dumps(work)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[0].removeprefix("BENCH_JSON "))


def test_ppo_worker_runs_a_step_and_its_floor(assets, bench_modules):
    from ppo_vs_trl import WORKLOAD

    work = dict(WORKLOAD, size="tiny", rep=1, policy=assets["tiny"]["policy"], rm=assets["tiny"]["rm"],
                prompts=assets["prompts"]) | TINY
    result = run_worker("rlflow_ppo_worker.py", work)
    assert result["side"] == "rlflow" and result["response_length"] == [4.0]
    assert len(result["update_s"]) == 1 and result["update_s"][0] > 0
    assert "timing_s/update_critic" in result["timings"][0]
    assert set(result["floor"]["parts"]) == {"generate", "reference_forward", "reward_forward", "actor_fwd_bwd",
                                             "critic_fwd_bwd"}
    # both sides trained on the same rows: what the orchestrator checks before it compares them
    assert result["prompt_ids_crc32"] == result["floor_prompt_ids_crc32"]
    assert result["config"]["rl"]["rollout_batch"] == 2 and result["config"]["ppo"]["whiten_advantages"] is True


def test_grpo_worker_runs_a_critic_free_step(assets, bench_modules):
    from grpo_bench import grpo_work
    from ppo_vs_trl import WORKLOAD

    work = grpo_work("tiny", assets, dict(WORKLOAD, rep=1), 1) | TINY | {"prompts_per_iter": 2, "generations": 2}
    result = run_worker("rlflow_grpo_worker.py", work)
    assert result["algo"] == "grpo" and result["response_length"] == [4.0]
    assert len(result["kl_loss"]) == 1 and result["config"]["algorithm"]["name"] == "grpo"
    assert result["config"]["rollout"]["n"] == 2


def test_off_policy_worker_runs_every_mode(assets, bench_modules):
    from off_policy_bench import MODES, work_for

    work = work_for("tiny", "ppo", assets, 1) | TINY
    result = run_worker("rlflow_off_policy_worker.py", work)
    assert sorted(result["runs"]) == sorted(MODES)
    for name, run in result["runs"].items():
        assert len(run["step_wall_s"]) == 1 and run["steps_s"] > 0, name
    assert result["runs"]["sync_slow"]["judge_delay_s"] > 0


def test_engine_bench_times_ppo_steps_and_an_sft_step(small_assets, bench_modules, monkeypatch):
    import engine_bench

    from rlflow.engine.config.execution import EngineConfig

    monkeypatch.setattr(engine_bench, "ASSETS", small_assets)
    for server in (False, True):
        times = engine_bench.ppo_seconds(EngineConfig(), server, 2)
        assert len(times) == 1 and times[0] > 0  # the first step is left out
    figures = engine_bench.sft_figures(EngineConfig(max_tokens_per_microbatch=1024, packing=True), 1)
    assert figures["seconds_per_step"] > 0 and figures["saved_activation_mb"] > 0


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_real_memory_worker_runs_an_rl_step(small_assets, algorithm, tmp_path):
    command = [sys.executable, str(BENCH / "real_memory.py"), "--model", str(small_assets / "tiny-model"),
               "--worker", algorithm, "1"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads(lines[0].removeprefix("RESULT "))
    assert row["case"] == algorithm and row["chunked"] is True
    assert 0 < row["response_length"] <= 32 and row["peak_rss_mb"] >= row["rss_before_mb"] > 0


def test_resume_bench_kills_and_continues_an_sft_worker(small_assets, bench_modules, tmp_path):
    from resume_bench import measure

    row = measure("0.4M", 128, 2, small_assets, tmp_path)
    assert row["params"] > 0 and row["checkpoint_bytes"] > 0
    assert row["resume_s"] >= row["step_s"] > 0 and row["resumed_process_wall_s"] > 0


# One process imports every script and parses its command line: one interpreter's imports, not fifteen.
PARSE_DRIVER = """
import json, runpy, sys
bench, parsed, names = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
sys.path.insert(0, bench)
results = {}
for name in names:
    sys.argv = [name, "--help"]
    try:
        runpy.run_path(f"{bench}/{name}", run_name="__main__" if name in parsed else "bench_import")
        results[name] = "imported"
    except SystemExit as stop:
        results[name] = f"exit {stop.code}"
print("PARSED " + json.dumps(results))
"""


def test_every_other_script_imports_and_parses_its_arguments(tmp_path):
    names = sorted(PARSE) + sorted(IMPORT)
    proc = subprocess.run([sys.executable, "-c", PARSE_DRIVER, str(BENCH), json.dumps(sorted(PARSE)), *names],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PARSED ")]
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(lines[0].removeprefix("PARSED "))
    assert results == {name: "exit 0" for name in PARSE} | {name: "imported" for name in IMPORT}
    assert proc.stdout.count("usage:") == len(PARSE)
    assert not list(tmp_path.iterdir())  # parsing wrote nothing


def test_summaries_compare_tells_identical_from_different(tmp_path, bench_modules, capsys):
    from summaries import main

    summary = {"_machine": "m", "demo-s0": {"summary": {"gold": 0.5}}}
    for name, tree in (("a", summary), ("b", summary), ("c", summary | {"demo-s0": {"summary": {"gold": 0.51}}})):
        (tmp_path / f"{name}.json").write_text(json.dumps(tree))
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "demo-s0: identical" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")]) == 1
    assert "demo-s0: DIFFERS" in capsys.readouterr().out
    assert main([]) == 2  # its usage, on stderr
