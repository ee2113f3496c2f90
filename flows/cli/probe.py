"""`rlflow probe CONFIG`: run a config's RL stage (algorithm.name ppo, grpo, rloo or reinforce_pp)
for a few steps and say what the whole run will take. DPO has no RL stage: it is refused.

Prints memory (peak RSS above the post-import baseline; on a GPU, torch's peak allocation), step
time (mean, p50, p90), tokens/s, the reward and KL trends, what `rlflow estimate` predicted for
the same config, and the full run's time and cost extrapolated from the measured steps. Logged
to MLflow as a run tagged rlflow.kind=probe. No checkpoint is written, no model registered.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from rlflow.engine.errors import ConfigError

GIB = 2**30


def probe_inputs(config: Any, reward_model: str | None) -> Any:
    """The RL stage's inputs for a probe (the stage's own builder, engine/stages/catalog.py), from
    these starting models: the config's policy as actor, reference and SFT policy. The round's
    reward model, only when reward.sources has a model without a path: from --reward-model, else
    rm.init when it names a folder, else a scalar head on the policy (zero: the reward trend then
    says nothing); sources with a path load their own. The critic, unless the algorithm is
    critic-free: the reward model (ppo.critic_init rm) or the policy."""
    from rlflow.engine.models.loading import resolve_model_path
    from rlflow.engine.stages.catalog import stage_inputs
    from rlflow.engine.stages.inputs import ModelInput, RewardModelInput
    from rlflow.engine.stages.rl.inputs import RLUpstream

    policy = resolve_model_path(config.model.path)
    reward, norm = None, None
    if config.reward.learned:
        reward = reward_model or (config.rm.init if config.rm.init != "sft" else policy)
        reward = resolve_model_path(reward, "--reward-model" if reward_model else "rm.init")
        norm = (0.0, 1.0)
    elif reward_model:
        raise ConfigError(
            "--reward-model: reward.sources has no learned reward model of the round (a model source without a"
            " path), so the probe loads none; drop the flag"
        )
    critic = None
    if not config.algorithm.critic_free:
        critic = reward if config.ppo.critic_init == "rm" and reward is not None else policy
    model = lambda path: ModelInput(uri=path, identity="probe")  # noqa: E731  # a probe has no identity
    upstream = RLUpstream(
        policy=model(policy), reference=model(policy), sft=model(policy),
        reward_model=None if reward is None else RewardModelInput(uri=reward, identity="probe", score_norm=norm),
        critic=None if critic is None else model(critic),
    )
    return stage_inputs(config, "rl", upstream)


def check_probe_config(config: Any, steps: int) -> None:
    if config.algorithm.name == "dpo":
        raise ConfigError(
            "rlflow probe runs the RL stage (algorithm.name ppo, grpo, rloo or reinforce_pp); algorithm.name=dpo"
            " has none: estimate the DPO stage with `rlflow estimate`"
        )
    if steps < 1:
        raise ConfigError(f"--steps must be at least 1, got {steps}")
    if config.resources.world_size > 1:
        raise ConfigError(
            f"rlflow probe runs one process; this config asks for {config.resources.world_size}"
            " (resources.nproc_per_node x nnodes): probe it with resources.nproc_per_node=1 and scale"
            " with `rlflow estimate --gpus N`"
        )
    if config.rollout.mode == "server":
        raise ConfigError("rlflow probe samples in-process; set rollout.mode=colocated for the probe")


def estimate_for_probe(config: Any, report: Any, device: str | None, reward_model: str | None) -> tuple[Any, str]:
    """`rlflow estimate`'s view of the probed config, with the prompts as long as they really are
    (the estimator pads every row to data.max_prompt_tokens, an upper bound): like for like."""
    from rlflow.flows.cli.estimate import estimate_config

    prompt_tokens = min(config.data.max_prompt_tokens, report.longest_prompt)
    probed = config.model_copy(update={"data": config.data.model_copy(update={"max_prompt_tokens": prompt_tokens})})
    return estimate_config(probed, device, reward_model)


def extrapolate(config: Any, step_s: float, price_per_hour: float, gpus: int) -> dict[str, float]:
    """Hours and cost of every round's RL steps at the measured mean step time."""
    steps = config.rl.steps * config.run.rounds
    hours = step_s * steps / 3600
    return {"rl_steps": steps, "hours": hours, "gpu_hours": hours * gpus, "cost": hours * gpus * price_per_hour}


def report_lines(report: Any, estimate: Any, currency: str, extra: dict[str, float]) -> list[str]:
    step, tokens, trends = report.step_seconds(), report.tokens_per_second(), report.trends()
    est_peak, est_step = estimate.memory.peak.total, estimate.step.total
    lines = [
        f"memory: peak RSS {report.peak_rss_above_baseline / GIB:.3f} GiB above the post-import baseline"
        f" ({report.baseline_rss / GIB:.2f} GiB); estimate {est_peak / GIB:.3f} GiB at the real prompt"
        f" width ({report.longest_prompt} tokens)"
        f" (measured/estimated {report.peak_rss_above_baseline / est_peak:.2f})",
    ]
    if report.gpu_peak_allocated is not None:
        lines.append(f"        GPU max allocated {report.gpu_peak_allocated / GIB:.2f} GiB")
    lines += [
        f"step time over {len(report.timed)} step(s) (the first is warm-up): mean {step['mean']:.3f} s,"
        f" p50 {step['p50']:.3f} s, p90 {step['p90']:.3f} s; estimate {est_step:.3f} s"
        f" (measured/estimated {step['mean'] / est_step:.2f})",
        "phases (median s): "
        + ", ".join(f"{k[len('timing_s/') :]} {v:.3f}" for k, v in report.phase_seconds().items()),
        f"throughput: {tokens['generated']:.0f} generated tokens/s, {tokens['processed']:.0f} processed tokens/s",
        f"trend per step: reward {trends['reward_per_step']:+.4f}, KL {trends['kl_per_step']:+.4f}"
        f" (reward {report.steps[0].reward:.3f} -> {report.steps[-1].reward:.3f},"
        f" KL {report.steps[0].kl:.4f} -> {report.steps[-1].kl:.4f})",
        f"full run ({extra['rl_steps']} {estimate.workload.algorithm_name} steps = rl.steps x run.rounds;"
        " SFT, reward model and evaluations"
        f" not included): {extra['hours']:.3f} h, {extra['gpu_hours']:.3f} device-hours,"
        f" {extra['cost']:.4g} {currency}",
        f"(loading took {report.load_seconds:.1f} s; nothing was written)",
    ]
    if report.episodes:
        turns = [s.turns for s in report.steps if s.turns is not None]
        lines.insert(-1, f"episodes: every prompt a multi-turn episode, {sum(turns) / len(turns):.2f} model turns"
                         " on average")
    return lines


def log_probe(config: Any, name: str, report: Any, estimate: Any, extra: dict[str, float]) -> str:
    """The probe as an MLflow run: per-step metrics, the summary as probe/* metrics."""
    from rlflow.tasks.tracking import RunTracker, resolve_tracking_uri

    tracker = RunTracker(resolve_tracking_uri(config.tracking.uri, config.run.root), config.tracking.experiment)
    run_id = tracker.probe_run(name, {"config": config.model_dump(mode="json"), "probe": {"steps": len(report.steps)}})
    sink = tracker.sink(run_id)
    for s in report.steps:
        sink.log_metrics(s.timings | {"critic/score/mean": s.reward, "actor/kl": s.kl}, s.step)
    step, tokens, trends = report.step_seconds(), report.tokens_per_second(), report.trends()
    summary = {
        "probe/peak_rss_above_baseline_gib": report.peak_rss_above_baseline / GIB,
        "probe/estimated_peak_gib": estimate.memory.peak.total / GIB,
        "probe/step_s_mean": step["mean"],
        "probe/step_s_p50": step["p50"],
        "probe/step_s_p90": step["p90"],
        "probe/estimated_step_s": estimate.step.total,
        "probe/generated_tokens_per_s": tokens["generated"],
        "probe/reward_slope": trends["reward_per_step"],
        "probe/kl_slope": trends["kl_per_step"],
        "probe/full_run_hours": extra["hours"],
        "probe/full_run_cost": extra["cost"],
    }
    if report.gpu_peak_allocated is not None:
        summary["probe/gpu_max_allocated_gib"] = report.gpu_peak_allocated / GIB
    sink.log_metrics(summary, len(report.steps))
    tracker.finish(run_id)
    return run_id


def probed_algorithm(config: Any) -> str:
    """e.g. "PPO", "GRPO (4 samples per prompt, no critic, multi-turn episodes of ToolEnv)": what the
    probe runs."""
    from rlflow.engine.estimate.workload import RL_ALGORITHMS

    name, n = RL_ALGORITHMS[config.algorithm.name], config.rollout.n
    notes = ([f"{n} samples per prompt"] if n > 1 else []) + (["no critic"] if config.algorithm.critic_free else [])
    if config.env is not None:
        notes.append(f"multi-turn episodes of {config.env.fn.rsplit(':', 1)[-1]} (up to {config.env.max_turns} turns)")
    return name + (f" ({', '.join(notes)})" if notes else "")


def command_probe(args: argparse.Namespace) -> int:
    from rlflow.engine.backend.factory import make_runtime
    from rlflow.engine.config.schema import load_config
    from rlflow.engine.estimate.probe import run_probe
    from rlflow.engine.stages.lifecycle import set_threads

    config = load_config(args.config, args.overrides)
    check_probe_config(config, args.steps)
    inputs = probe_inputs(config, args.reward_model)
    set_threads(config.run.threads)
    runtime = make_runtime(config.engine)
    what = probed_algorithm(config)
    print(f"rlflow: probing {args.steps} {what} step(s) of {args.config} on {runtime.device}", flush=True)

    def show(step: Any) -> None:
        print(f"  step {step.step}: {step.seconds:.3f} s, reward {step.reward:.3f}, KL {step.kl:.4f}", flush=True)

    try:
        report = run_probe(inputs, runtime, args.steps, show)
    finally:
        runtime.close()
    estimate, currency = estimate_for_probe(config, report, args.gpu, args.reward_model)
    extra = extrapolate(config, report.step_seconds()["mean"], estimate.device.price_per_gpu_hour, estimate.gpus_billed)
    for line in report_lines(report, estimate, currency, extra):
        print(line)
    if not args.no_tracking:
        name = f"probe-{config.run.name or Path(args.config).stem}"
        print(f"MLflow run {log_probe(config, name, report, estimate, extra)} ({name})")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "probe", help="run a config's RL stage for a few steps: memory, step time, trends, full-run cost"
    )
    p.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--steps", type=int, default=int(os.environ.get("RLFLOW_PROBE_STEPS", "20")))
    p.add_argument(
        "--reward-model", help="the round's reward model directory (default: rm.init, else a zero head on the policy)"
    )
    p.add_argument("--gpu", help="a device name of configs/prices.yaml, for the cost (default: resources.gpu_type)")
    p.add_argument("--no-tracking", action="store_true", help="do not log the probe to MLflow")
    p.set_defaults(handler=command_probe)
