"""The execution sections (rlflow.engine.config.execution): per-stage policies inherit stage.*, the
engine refuses inconsistent ZeRO settings, and a job's world size is processes x nodes."""

import pytest
from pydantic import ValidationError

from rlflow.engine.config.execution import (
    CheckpointConfig,
    EngineConfig,
    ResourcesConfig,
    RolloutConfig,
    StageConfig,
    StagePolicy,
)

STAGES = ("sft", "label", "rm", "rl", "dpo", "eval")


def test_a_stage_policy_takes_each_unset_key_from_stage_and_keeps_a_set_zero():
    stage = StageConfig(
        retries=2, retry_delay_s=5.0, hang_timeout_s=100.0, rl=StagePolicy(retries=0, hang_timeout_s=7.0)
    )
    assert stage.policy("rl") == StagePolicy(retries=0, retry_delay_s=5.0, hang_timeout_s=7.0)
    for name in set(STAGES) - {"rl"}:
        assert stage.policy(name) == StagePolicy(retries=2, retry_delay_s=5.0, hang_timeout_s=100.0), name
    defaults = StageConfig().policy("sft")
    assert (defaults.retries, defaults.retry_delay_s, defaults.hang_timeout_s) == (0, 10.0, 3600.0)
    # no watchdog at stage level: every stage inherits None unless it sets its own
    unwatched = StageConfig(hang_timeout_s=None, dpo=StagePolicy(hang_timeout_s=60.0))
    assert unwatched.policy("eval").hang_timeout_s is None and unwatched.policy("dpo").hang_timeout_s == 60.0


def test_stage_policy_bounds_name_the_field():
    for keys, field in (({"retries": -1}, "retries"), ({"hang_timeout_s": 0}, "hang_timeout_s")):
        with pytest.raises(ValidationError) as info:
            StagePolicy(**keys)
        assert info.value.errors()[0]["loc"] == (field,)


def test_offloading_parameters_needs_zero3_and_says_so():
    with pytest.raises(ValidationError, match=r"engine\.offload_params needs engine\.zero_stage=3 \(got 2\)"):
        EngineConfig(offload_params=True)
    with pytest.raises(ValidationError, match=r"\(got 1\)"):
        EngineConfig(offload_params=True, zero_stage=1)
    assert EngineConfig(offload_params=True, zero_stage=3).offload_params
    assert EngineConfig(offload_optimizer=True, zero_stage=1).offload_optimizer  # any stage may offload that
    with pytest.raises(ValidationError):
        EngineConfig(max_tokens_per_microbatch=7)  # below one short sequence


def test_world_size_is_processes_per_node_times_nodes():
    assert ResourcesConfig().world_size == 1
    assert ResourcesConfig(nproc_per_node=4, nnodes=3).world_size == 12
    assert ResourcesConfig(nproc_per_node=64, nnodes=2).world_size == 128
    for keys in ({"nproc_per_node": 65}, {"nnodes": 0}, {"master_port": 70000}, {"launcher": "mpirun"}):
        with pytest.raises(ValidationError):
            ResourcesConfig(**keys)


def test_checkpoint_and_rollout_defaults_and_bounds():
    ckpt = CheckpointConfig()
    assert (ckpt.every_steps, ckpt.keep_last, ckpt.consolidate_every, ckpt.mirror) == (10, 2, 5, None)
    with pytest.raises(ValidationError) as info:
        CheckpointConfig(keep_best_mode="best")
    assert info.value.errors()[0]["loc"] == ("keep_best_mode",)
    assert CheckpointConfig(mirror_retries=0).mirror_retries == 0  # no retries is allowed, a 0 s backoff is not
    with pytest.raises(ValidationError):
        CheckpointConfig(mirror_backoff_s=0)
    assert (RolloutConfig().mode, RolloutConfig().n) == ("colocated", 1)
    with pytest.raises(ValidationError):
        RolloutConfig(n=1025)


def test_off_policy_steps_default_to_synchronous_and_need_a_rollout_worker():
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.errors import ConfigError

    assert (RolloutConfig().off_policy_steps, RolloutConfig().threads) == (0, None)
    with pytest.raises(ValidationError):
        RolloutConfig(off_policy_steps=-1)
    served = build_config({"rollout": {"mode": "server", "off_policy_steps": 2, "threads": 1}}, "t").rollout
    assert (served.off_policy_steps, served.threads) == (2, 1)
    fix = r"rollout.off_policy_steps=1 .* needs rollout.mode=server \(got colocated\); set rollout.mode=server"
    with pytest.raises(ConfigError, match=fix):
        build_config({"rollout": {"off_policy_steps": 1}}, "t")


def test_async_rollout_is_spelled_async_needs_a_worker_and_refuses_what_it_cannot_run():
    from rlflow.engine.config.schema import build_config, to_yaml
    from rlflow.engine.errors import ConfigError

    default = RolloutConfig()
    assert (default.async_, default.max_staleness, default.partial_rollouts) == (False, 1, False)
    server = {"mode": "server"}
    on = build_config({"rollout": server | {"async": True, "partial_rollouts": True, "max_staleness": 3}}, "t")
    assert (on.rollout.async_, on.rollout.staleness_bound, on.rollout.samples_ahead) == (True, 3, True)
    assert "async: true" in to_yaml(on)  # dumped as typed, so a saved config loads again
    assert build_config({"rollout": server | {"off_policy_steps": 2}}, "t").rollout.staleness_bound == 2
    refusals = {
        "needs rollout.mode=server \\(got colocated\\); set rollout.mode=server": {"async": True},
        "two schedules of the replicas: keep one": server | {"async": True, "off_policy_steps": 1},
        "partial_rollouts=true continues .* set rollout.async=true": server | {"partial_rollouts": True},
        "unknown key 'rollout.async_' in rollout; valid keys: async, bucket_mb": {"async_": True},
    }
    for message, rollout in refusals.items():
        with pytest.raises(ConfigError, match=message):
            build_config({"rollout": rollout}, "t")


def test_the_guards_logprob_stop_is_the_measured_one_of_the_sampler_and_dtype_unless_set():
    from rlflow.engine.config.execution import LOGPROB_DIFF_STOPS

    assert RolloutConfig().dtype == "float32" and RolloutConfig().logprob_diff_stop == 1e-3
    vllm = dict(mode="server", server_backend="vllm")
    assert RolloutConfig(**vllm).logprob_diff_stop == LOGPROB_DIFF_STOPS[("vllm", "float32")] == 2e-3
    assert RolloutConfig(**vllm, dtype="bfloat16").logprob_diff_stop == 5.0  # the tail of bf16 rounding
    assert RolloutConfig(**vllm, dtype="bfloat16", max_logprob_diff=0.5).logprob_diff_stop == 0.5
    assert {(b, d) for b in ("hf", "vllm") for d in ("float32", "bfloat16")} == set(LOGPROB_DIFF_STOPS)
    with pytest.raises(ValidationError):
        RolloutConfig(dtype="float16")


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(transport="gloo"), "rollout.transport=gloo moves weights to rollout replicas: it needs rollout.mode="),
        (dict(mode="server", server_backend="vllm", transport="fsspec"), "rollout.transport=fsspec writes the weights"),
        (
            dict(mode="server", server_backend="vllm", transport="shm", endpoints=["http://10.0.0.7:8000"]),
            "rollout.transport=shm maps the trainer's memory",
        ),
        (
            dict(mode="server", server_backend="vllm", transport="fsspec", weights_url="s3://AKIA:hunter2@bucket/w"),
            "rollout.weights_url: 's3://***@bucket/w' carries credentials",
        ),
    ],
)
def test_a_weight_transport_that_cannot_work_is_refused_naming_the_fix(fields, message):
    """Through the loader, as `rlflow run` reports it: one line, the credentials never in it."""
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        build_config({"rollout": fields}, "run.yaml")
    assert str(info.value).startswith(f"run.yaml: {message}") and "hunter2" not in str(info.value)


def test_fsspec_weights_need_only_a_folder_both_sides_reach():
    cfg = RolloutConfig(mode="server", server_backend="vllm", transport="fsspec", weights_url="s3://bucket/weights")
    assert (cfg.transport, cfg.weights_url) == ("fsspec", "s3://bucket/weights")
    hf = RolloutConfig(mode="server", transport="gloo")  # every backend's replica has every channel
    assert (hf.server_backend, hf.transport) == ("hf", "gloo")
