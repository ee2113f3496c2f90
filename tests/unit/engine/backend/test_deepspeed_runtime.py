"""The DeepSpeed backend's parts that run in one CPU process without a process group
(rlflow.engine.backend.deepspeed_runtime): the DeepSpeed config built from engine.* and the world of
one a bare process describes. DeepSpeedRuntime itself needs deepspeed.init_distributed: real jobs in
tests/scenarios/test_backend_parity.py and test_distributed.py."""

import os

import torch

from rlflow.engine.backend.deepspeed_runtime import _single_process_env, ds_config
from rlflow.engine.config.execution import EngineConfig

DEEPSPEED = {"backend": "deepspeed"}
# What every config holds whatever the engine section says (one process here: train_batch_size 1).
COMMON = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "train_batch_size": 1,
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "steps_per_print": 10**9,
    "wall_clock_breakdown": False,
}
CPU = {"device": "cpu", "pin_memory": torch.cuda.is_available()}


def test_a_zero2_training_config_clips_and_leaves_accumulation_to_the_stage():
    config = ds_config(EngineConfig(**DEEPSPEED, zero_stage=2), max_grad_norm=0.5, bf16=False, train=True)
    assert config == COMMON | {
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": False},
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.5,
    }


def test_a_zero3_frozen_model_config_has_no_optimizer_keys_and_keeps_small_layers_partitioned():
    config = ds_config(EngineConfig(**DEEPSPEED, zero_stage=3), max_grad_norm=None, bf16=True, train=False)
    assert config == COMMON | {
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 10**9,
        },
        "bf16": {"enabled": True},
    }


def test_offloading_puts_optimizer_state_on_the_host_only_when_training_and_parameters_always():
    cfg = EngineConfig(**DEEPSPEED, zero_stage=3, offload_optimizer=True, offload_params=True)
    trained = ds_config(cfg, 1.0, bf16=False, train=True)["zero_optimization"]
    frozen = ds_config(cfg, None, bf16=False, train=False)["zero_optimization"]
    assert trained["offload_optimizer"] == CPU and trained["offload_param"] == CPU
    assert "offload_optimizer" not in frozen and frozen["offload_param"] == CPU
    zero1 = ds_config(EngineConfig(**DEEPSPEED, zero_stage=1, offload_optimizer=True), 1.0, False, True)
    assert zero1["zero_optimization"] == {"stage": 1, "offload_optimizer": CPU}


def test_a_bare_process_describes_a_world_of_one_and_a_launched_rank_is_left_alone(monkeypatch):
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for name in names:  # setenv first so that monkeypatch removes what the function sets
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    _single_process_env()
    env = {name: os.environ[name] for name in names}
    one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert {k: env[k] for k in names[:4]} == one
    assert 0 < int(env["MASTER_PORT"]) < 65536
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    _single_process_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("5", "8")
