"""The RL step is opened one way: through the RL-run entry point (engine/stages/rl/run.py RLRun.open).
Outside the RL package and the builders' own unit tests, no module of the engine, the tasks, the
flows, the bench, infra or the tests imports or calls what builds a step: the step's pieces, the
objective, the reward source and its pool, the models, the KL controller."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("engine", "tasks", "flows", "bench", "infra", "tests")

# What builds or runs a step by hand, by module.
BUILDERS = {
    "rlflow.engine.stages.rl.step": {"sample_step", "rl_update", "single_pass_update", "after_update",
                                     "make_controller", "with_timings"},
    "rlflow.engine.stages.rl.run": {"load_rl_models", "load_prompt_sets"},
    "rlflow.engine.rewards.sources": {"build_reward_source", "start_reward_pool"},
}
CALLS = {("Objective", "of")}  # attribute calls: Objective.of(...)

# The RL package itself, and the unit tests of the builders.
ALLOWED = {
    "engine/stages/rl/",
    "tests/unit/engine/stages/rl/test_step.py",
    "tests/unit/engine/stages/rl/test_run.py",
    "tests/unit/engine/stages/rl/test_experience.py",
    "tests/unit/engine/rewards/test_sources.py",
    "tests/unit/engine/algorithms/test_advantages.py",
    "tests/test_rl_entry.py",
}


def hand_built(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in BUILDERS:
            found += [f"imports {node.module}.{a.name}" for a in node.names if a.name in BUILDERS[node.module]]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and (owner.id, node.func.attr) in CALLS:
                found.append(f"calls {owner.id}.{node.func.attr}")
    return found


def offenders(repo: Path) -> list[str]:
    out = []
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            if any(rel.startswith(allowed) for allowed in ALLOWED):
                continue
            out += [f"{rel}: {what}" for what in hand_built(ast.parse(path.read_text()))]
    return out


def test_nothing_outside_the_rl_package_builds_a_step_by_hand():
    assert offenders(REPO) == []


def test_the_check_finds_a_step_built_by_hand(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "old.py").write_text(
        "from rlflow.engine.stages.rl.step import make_controller\n"
        "from rlflow.engine.rewards.sources import build_reward_source\n"
        "objective = Objective.of(config)\n"
    )
    assert offenders(tmp_path) == [
        "bench/old.py: imports rlflow.engine.stages.rl.step.make_controller",
        "bench/old.py: imports rlflow.engine.rewards.sources.build_reward_source",
        "bench/old.py: calls Objective.of",
    ]
