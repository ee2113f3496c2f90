"""GPU placement is checked before anything loads: one-line errors naming role, index and
CUDA_VISIBLE_DEVICES; the default (nothing placed) is valid everywhere, CPU-only included."""

import re

import pytest
import yaml
from rlflow.engine.config.execution import PlacementConfig
from rlflow.engine.errors import ConfigError
from rlflow.engine.backend.placement import devices_for, validate_placement, visible_gpu_count
from rlflow.flows.cli.main import main


def check(train=None, rollout=None, mode="colocated", gpus=4, cvd="0,1,2,3"):
    validate_placement(PlacementConfig(train=train, rollout=rollout), mode, gpus, cvd)


@pytest.mark.parametrize("gpus, cvd", [(0, None), (0, ""), (1, None), (8, "0,1,2,3,4,5,6,7")])
@pytest.mark.parametrize("mode", ["colocated", "server"])
def test_default_placement_is_always_valid(gpus, cvd, mode):
    check(mode=mode, gpus=gpus, cvd=cvd)
    assert devices_for(None, cvd) is None  # nothing placed: every role inherits the parent's devices


@pytest.mark.parametrize(
    ("kwargs", "train_devices", "rollout_devices"),
    [
        ({"train": [0, 1], "rollout": [2, 3], "mode": "server"}, "4,5", "6,7"),
        ({"train": [0, 1], "mode": "server"}, "4,5", None),
        ({"rollout": [3], "mode": "server"}, None, "7"),
        ({"train": [1, 0], "rollout": [0, 1]}, "5,4", "4,5"),  # colocated: same devices, any order
        ({"rollout": [0, 1, 2, 3]}, None, "4,5,6,7"),  # colocated, train unset = all visible GPUs
        ({"train": [2]}, "6", None),
    ],
)
def test_valid_placements_map_to_the_parents_device_ids(kwargs, train_devices, rollout_devices):
    check(**kwargs, cvd="4,5,6,7")
    # Indices count the GPUs this process sees; a role's processes get the ids the parent was given.
    assert devices_for(kwargs.get("train"), "4,5,6,7") == train_devices
    assert devices_for(kwargs.get("rollout"), "4,5,6,7") == rollout_devices
    plain = None if train_devices is None else ",".join(str(i) for i in kwargs["train"])
    assert devices_for(kwargs.get("train"), None) == plain  # no CUDA_VISIBLE_DEVICES: the indices themselves


ERRORS = {
    "index out of range": (
        {"train": [0, 4]},
        r"^placement\.train=\[0, 4\]: GPU index 4 is out of range, 4 GPU\(s\) are visible \(CUDA_VISIBLE_DEVICES='0,1,2,3'\)",
    ),
    "negative index": (
        {"rollout": [-1], "mode": "server"},
        r"^placement\.rollout=\[-1\]: GPU index -1 is out of range",
    ),
    "empty list": ({"rollout": [], "mode": "server"}, r"^placement\.rollout=\[\] names no GPU"),
    "duplicate": ({"train": [1, 2, 1]}, r"^placement\.train=\[1, 2, 1\] lists GPU index 1 twice \(CUDA_VISIBLE"),
    "server overlap": (
        {"train": [0, 1], "rollout": [1, 2], "mode": "server"},
        (
            r"placement\.train=\[0, 1\] and placement\.rollout=\[1, 2\] share GPU index 1"
            r" \(CUDA_VISIBLE_DEVICES='0,1,2,3'\).*rollout\.mode=server"
        ),
    ),
    "colocated differs": (
        {"train": [0, 1], "rollout": [2, 3]},
        (
            r"placement\.rollout=\[2, 3\] differs from placement\.train=\[0, 1\] at GPU index 0"
            r" \(CUDA_VISIBLE_DEVICES=.*rollout\.mode=colocated"
        ),
    ),
    "colocated subset of all": (
        {"rollout": [0]},
        r"placement\.rollout=\[0\] differs from placement\.train=\[0, 1, 2, 3\] at GPU index 1",
    ),
    "no gpu visible": (
        {"train": [0], "gpus": 0, "cvd": None},
        r"^placement\.train=\[0\] asks for GPU index 0 but no GPU is visible \(CUDA_VISIBLE_DEVICES unset\)",
    ),
    "no gpu visible (hidden)": (
        {"rollout": [1], "mode": "server", "gpus": 0, "cvd": ""},
        r"^placement\.rollout=\[1\] asks for GPU index 1 but no GPU is visible \(CUDA_VISIBLE_DEVICES=''\)",
    ),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_placement_is_a_one_line_config_error(case):
    kwargs, pattern = ERRORS[case]
    with pytest.raises(ConfigError) as info:
        check(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(pattern, message), message


def test_visible_gpu_count_matches_torch():
    import torch

    assert visible_gpu_count() == torch.cuda.device_count()


@pytest.mark.skipif(visible_gpu_count() > 0, reason="checks the no-GPU message; this machine has a GPU")
def test_cli_rejects_gpu_placement_on_a_cpu_machine(tmp_path, capsys, monkeypatch):
    """The placement check comes first among the CLI's pre-checks: the model and data paths here
    do not exist, yet the error is about placement (and nothing was started or written)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "c.yaml"
    missing = tmp_path / "absent"
    tree = {"run": {"name": "t", "root": str(tmp_path / "runs")}, "model": {"path": str(missing)}}
    tree["data"] = {"sft": str(missing / "sft.jsonl")}
    path.write_text(yaml.safe_dump(tree))
    code = main(["run", str(path), "placement.train=[0]"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("rlflow: error: placement.train=[0] asks for GPU index 0 but no GPU is visible"), err
    assert "CUDA_VISIBLE_DEVICES unset" in err
    assert not (tmp_path / "runs").exists()


def test_role_devices_map_through_the_parents_visible_gpus():
    from rlflow.engine.backend.placement import devices_for

    assert devices_for(None, "3,5") is None  # no placement: the processes inherit the parent's GPUs
    assert devices_for([0, 1], None) == "0,1"
    assert devices_for([1, 2], "4, 6,7") == "6,7"  # index 1 of what this process sees is GPU 6
