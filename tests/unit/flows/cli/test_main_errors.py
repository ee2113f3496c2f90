"""Bad input: one line naming the problem, exit code 2, no traceback, before any server starts."""

import json

import pytest
import yaml

from conftest import small_config_tree
from rlflow.flows.cli.main import main


@pytest.fixture
def write_config(small_assets, tmp_path):
    def write(**sections):
        tree = small_config_tree(small_assets, tmp_path / "runs", **sections)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump(tree))
        return str(path)

    return write


def run_cli(capsys, *argv):
    code = main(["run", *argv])
    err = capsys.readouterr().err.strip()
    return code, err


def data_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CASES = {
    "unknown key": (lambda t, w: (w(), "ppo.stepz=3"), r"unknown key 'ppo.stepz' in ppo; valid keys: .*steps"),
    "wrong type": (lambda t, w: (w(), "rl.steps=many"), r"invalid value for 'rl.steps': 'many'"),
    "missing data file": (lambda t, w: (w(data={"sft": str(t / "nope.jsonl")}),), r"data file not found: .*nope.jsonl"),
    "malformed jsonl": (
        lambda t, w: (w(data={"prompts": data_file(t, "p.jsonl", '{"prompt": "a"}\n{"prompt": \n')}),),
        r"p.jsonl:2: .*JSON",
    ),
    "missing field": (
        lambda t, w: (
            w(data={"preferences": data_file(t, "pr.jsonl", json.dumps({"prompt": "a", "chosen": "b"}) + "\n")}),
        ),
        r"pr.jsonl:1: missing field 'rejected'",
    ),
    "empty dataset": (
        lambda t, w: (w(data={"eval_prompts": data_file(t, "e.jsonl", "\n")}),),
        r"e.jsonl contains no records",
    ),
    "missing model": (
        lambda t, w: (w(model={"path": str(t / "no-model")}),),
        r"model.path .*no-model.* does not exist",
    ),
    "unsafe run name": (lambda t, w: (w(), "run.name=../../etc"), r"not safe for a path"),
    "missing config": (lambda t, w: (str(t / "absent.yaml"),), r"config file not found"),
    "torch backend on 2 processes": (
        lambda t, w: (w(), "resources.nproc_per_node=2"),
        r"resources.nproc_per_node=2 x resources.nnodes=1 needs engine.backend=deepspeed",
    ),
    "multi-node torchrun without a port": (
        lambda t, w: (
            w(
                engine={"backend": "deepspeed"},
                resources={"nnodes": 2},
                rollout={"generate_batch": 8},
                eval={"batch_size": 16},
            ),
        ),
        r"resources.nnodes=2 with launcher torchrun needs resources.master_port",
    ),
    "a rank without rows": (
        lambda t, w: (w(engine={"backend": "deepspeed"}, resources={"nproc_per_node": 2}),),
        r"rl.rollout_batch x rollout.n / rollout.generate_batch chunks = 1 is less than the 2 ranks"
        r" .*make it at least 2",
    ),
    "an env class that does not exist": (
        lambda t, w: (w(data={"chat_template": "auto"}, env={"fn": "helpers.envs:NoSuchEnv"}),),
        r"env.fn 'helpers.envs:NoSuchEnv': helpers.envs has no class 'NoSuchEnv'",
    ),
    "an env with the wrong signature": (
        lambda t, w: (w(data={"chat_template": "auto"}, env={"fn": "helpers.envs:StepTakesNothing"}),),
        r"StepTakesNothing.step must take one argument \(assistant_message\), it takes \(\)",
    ),
    "an env of fewer than one turn": (
        lambda t, w: (w(data={"chat_template": "auto"}, env={"fn": "helpers.envs:ScriptedEnv", "max_turns": 0}),),
        r"env.max_turns.*greater than or equal to 1",
    ),
    "a tool with an invalid schema": (
        lambda t, w: (w(data={"chat_template": "auto"}, env={"fn": "helpers.envs:BadToolEnv"}),),
        r"tool 'scale': argument 'x' has type 'float'; valid: string, integer",
    ),
    "an env with rollout replicas": (
        lambda t, w: (
            w(data={"chat_template": "auto"}, env={"fn": "helpers.envs:ScriptedEnv"}, rollout={"mode": "server"}),
        ),
        r"env with rollout.mode=server is not supported yet .*set rollout.mode=colocated",
    ),
    "vllm without its environment": (
        lambda t, w: (w(rollout={"mode": "server", "server_backend": "vllm", "vllm_python": str(t / "none")}),),
        r"rollout.vllm_python=.*does not exist: build it with `make vllm-env`",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gets_one_line_and_exit_2(case, capsys, tmp_path, write_config):
    make_args, pattern = CASES[case]
    code, err = run_cli(capsys, *make_args(tmp_path, write_config))
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("rlflow: error: ")
    assert __import__("re").search(pattern, err), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("manifest.json"))


# ---- `rlflow import-model` and `rlflow data gym`: one line, exit 2, nothing written

def _not_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"\x89PNG not a model")
    return ["import-model", str(tmp_path / "model.gguf"), str(tmp_path / "out")]


REAL_CASES = {
    "a file that is not GGUF": (
        _not_gguf,
        "import source '{t}/model.gguf' is not a GGUF file (it starts with b'\\x89PNG', not b'GGUF'); give a .gguf"
        " file, a folder holding one, or package:NAME for an installed package that ships one",
    ),
    "a package that holds no model file": (
        lambda t: ["import-model", "package:pytest", str(t / "out")],
        "package 'pytest' holds no model file (no .gguf in {pytest}); give a .gguf file, or use a Hugging Face"
        " directory directly as model.path",
    ),
    "an unknown gym dataset": (
        lambda t: ["data", "gym", "chain_summ", "--size", "8", "--out", str(t / "out")],
        "unknown gym dataset 'chain_summ'; valid: {datasets}",
    ),
    "a gym config key the dataset rejects": (
        lambda t: ["data", "gym", "chain_sum", "--size", "8", "--config", "max_digit=2", "--out", str(t / "out")],
        "gym dataset 'chain_sum' has no config key 'max_digit'; valid: min_terms, max_terms, min_digits, max_digits,"
        " allow_negation",
    ),
    "a gym config the dataset's own check refuses": (
        lambda t: ["data", "gym", "chain_sum", "--size", "8", "--config", "min_digits=3", "--config", "max_digits=1",
                   "--out", str(t / "out")],
        "gym dataset 'chain_sum' rejects config {'min_digits': 3, 'max_digits': 1}: max_digits must be >= min_digits",
    ),
}


@pytest.mark.parametrize("name", list(REAL_CASES))
def test_import_and_gym_bad_inputs(name, capsys, tmp_path):
    import importlib.util

    from reasoning_gym.factory import DATASETS

    argv, expected = REAL_CASES[name]
    pytest_folder = importlib.util.find_spec("pytest").submodule_search_locations[0]
    for key, value in {"{t}": tmp_path, "{pytest}": pytest_folder, "{datasets}": ", ".join(sorted(DATASETS))}.items():
        expected = expected.replace(key, str(value))
    assert main(argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"rlflow: error: {expected}"
    assert not (tmp_path / "out").exists()
