"""`rlflow estimate [CONFIG] [key=value ...]`: what a round's training stage will cost before it starts.

Reads the config as `rlflow run` does (the same loader and overrides), turns it into the
estimator's workload (the RL stage of algorithm.name ppo/grpo/rloo/reinforce_pp, or the DPO
stage) and Strategy (engine/estimate*.py), and prints memory per GPU by component and phase,
time per step by phase, hours, GPU-hours, money, and the cheapest plan that fits.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlflow.engine.config.schema import Config, apply_override, build_config, load_config
from rlflow.flows.compare import PRICES
from rlflow.engine.errors import ConfigError, RlflowError
from rlflow.engine.estimate.cost import MEMORY_MARGIN, Estimate, Recommendation, estimate_rl, recommend
from rlflow.engine.estimate.hardware import CPU_DEVICE, DeviceSpec, device_spec, load_price_book, measure_cpu
from rlflow.engine.estimate.memory import GIB
from rlflow.engine.estimate.model_shape import LoraShape, ModelShape, resolve_model
from rlflow.engine.estimate.workload import (
    OFFLOADS,
    ROLLOUT_ENGINES,
    AnyWorkload,
    BackendPrecisions,
    DPOWorkload,
    Strategy,
    Workload,
)



def read_config(config: str | None, overrides: list[str]) -> Config:
    """The config file with overrides, or the defaults with overrides when no file is given (a first
    positional that is a key=value and not a file is an override)."""
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]
    if config is not None:
        return load_config(config, overrides)
    tree: dict[str, Any] = {}
    for override in overrides:
        apply_override(tree, override)
    return build_config(tree, "defaults" + (" (with overrides)" if overrides else ""))


def model_shapes(config: Config, model: str | None, reward_model: str | None) -> dict[str, Any]:
    """Actor/reference from --model or model.path. The round's reward model (only when
    reward.sources has a model without a path) from --reward-model, else rm.init when it names a
    folder, else the policy's shape; reward.sources models with a path from their config.json. The
    critic (none for a critic-free algorithm) starts from the reward model (ppo.critic_init rm) or
    the policy."""
    policy = _shape(model, "--model") if model else _shape(config.model.path, "model.path")
    if reward_model and not config.reward.learned:
        raise ConfigError(
            "--reward-model: reward.sources has no learned reward model of the round (a model source without"
            " a path), so there is none to estimate; drop the flag"
        )
    reward = None
    if config.reward.learned:
        if reward_model:
            reward = _shape(reward_model, "--reward-model")
        else:
            reward = policy if config.rm.init == "sft" else _shape(config.rm.init, "rm.init")
    extra = tuple(
        _shape(s.path, f"reward.sources[{s.name}].path")
        for s in config.reward.sources
        if s.type == "model" and s.path is not None
    )
    critic = None
    if not config.algorithm.critic_free:
        critic = reward if config.ppo.critic_init == "rm" and reward is not None else policy
    return {"actor": policy, "reference": policy, "critic": critic, "reward": reward, "extra_rewards": extra}


def _shape(spec: str, key: str) -> ModelShape:
    """resolve_model with the flag or config key that named the model in its error."""
    try:
        return resolve_model(spec)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def rollout_setup(config: Config, engine: str | None, rollout_gpus: int | None) -> tuple[str, int]:
    """(engine, dedicated GPUs): vLLM when rollout.mode=server with server_backend vllm; its own GPUs
    are placement.rollout minus placement.train (none: it shares the training GPUs)."""
    server = config.rollout.mode == "server" and config.rollout.server_backend == "vllm"
    chosen = engine or ("vllm" if server else "hf")
    if rollout_gpus is None:
        own = set(config.placement.rollout or ()) - set(config.placement.train or ())
        rollout_gpus = len(own) if chosen == "vllm" else 0
    if chosen == "hf" and rollout_gpus:
        raise ConfigError("--rollout-gpus needs --rollout vllm: HF generate samples on the training GPUs")
    return chosen, rollout_gpus


def preference_pairs(config: Config, pairs: int | None) -> tuple[int, int]:
    """(pairs DPO trains on per epoch, held-out pairs the reference pass also scores). --pairs N
    gives the first and reads nothing (the held-out set then counts 0: it is small). Else the
    non-tied pairs of data.preferences (with dpo.include_offline) plus, when rounds label online,
    label.prompts_per_round fresh pairs (an upper bound: the largest round's stage), and the
    pairs of data.preferences_eval."""
    from rlflow.engine.data.records import load_preference_pairs

    def count(url: str | None, key: str) -> int:
        if url is None:  # the config names no such file
            return 0
        try:
            return sum(p.chosen != p.rejected for p in load_preference_pairs(url, config.data.storage_options))
        except (RlflowError, OSError) as exc:
            raise ConfigError(f"{key}: cannot count its pairs ({exc}); give the number with --pairs N") from None

    if pairs is not None:
        if pairs < 1:
            raise ConfigError(f"--pairs must be at least 1, got {pairs}")
        return pairs, 0
    label = config.label
    online = label.online_from_round is not None and label.online_from_round < config.run.rounds
    offline = count(config.data.preferences, "data.preferences") if config.dpo.include_offline else 0
    pairs = offline + (label.prompts_per_round if online else 0)
    if pairs < 1:
        raise ConfigError("DPO has no preference pairs: set dpo.include_offline=true, online labels, or --pairs N")
    return pairs, count(config.data.preferences_eval, "data.preferences_eval")


def lora_shape(config: Config, stage: str) -> LoraShape | None:
    """model.lora as the estimate's LoraShape when it applies to `stage` ("rl" or "dpo")."""
    lora = config.model.lora_for(stage)
    if lora is None:
        return None
    targets = ("all-linear",) if lora.target_modules == "all-linear" else tuple(lora.target_modules)
    return LoraShape(lora.r, targets, tuple(m.rsplit(".", 1)[-1] for m in lora.modules_to_save))  # short names


def build_dpo_workload(config: Config, args: argparse.Namespace, precision: Any) -> DPOWorkload:
    """The DPO stage of `config`: the policy (and its reference, same shape) over the pairs."""
    if args.reward_model:
        raise ConfigError("--reward-model: algorithm.name=dpo trains without a reward model; drop the flag")
    if args.rollout or args.rollout_gpus:
        raise ConfigError("--rollout/--rollout-gpus: algorithm.name=dpo samples nothing; drop the flag")
    policy = _shape(args.model, "--model") if args.model else _shape(config.model.path, "model.path")
    pairs, held_out = preference_pairs(config, getattr(args, "pairs", None))
    return DPOWorkload(
        actor=policy,
        reference=policy,
        pairs=pairs,
        batch_size=config.dpo.batch_size,
        epochs=config.dpo.epochs,
        seq_tokens=config.dpo.max_seq_tokens,
        precision=precision,
        held_out_pairs=held_out,
        micro_batch_size=config.engine.micro_batch_size,
        max_tokens_per_microbatch=config.engine.max_tokens_per_microbatch,
        lora=lora_shape(config, "dpo"),
    )


def build_inputs(
    config: Config, args: argparse.Namespace, device: DeviceSpec
) -> tuple[AnyWorkload, Strategy, BackendPrecisions]:
    """The workload (the RL stage, or DPO's with algorithm.name=dpo) in the configured strategy's
    precision, that strategy (flags win over the config) and both backends' precisions for the
    plan search."""
    eng = config.engine
    zero = args.zero if args.zero is not None else (eng.zero_stage if eng.backend == "deepspeed" else 0)
    offload = args.offload or ("all" if eng.offload_params else "optimizer" if eng.offload_optimizer else "none")
    strategy = Strategy(
        zero_stage=zero,
        n_gpus=args.gpus if args.gpus is not None else config.resources.world_size,
        offload=offload,
        gradient_checkpointing=eng.gradient_checkpointing,
        offload_frozen_models=eng.offload_frozen_models,
    )
    precisions = BackendPrecisions.of(eng.precision, config.model.dtype, on_gpu=not device.is_cpu)
    if config.model.lora is not None and strategy.zero_stage != 0:
        raise ConfigError(f"--zero {strategy.zero_stage}: model.lora trains on the torch backend only; drop --zero")
    if config.algorithm.name == "dpo":
        workload = build_dpo_workload(config, args, precisions.for_stage(strategy.zero_stage))
        problem = workload.rank_shares_problem(strategy.n_gpus)
        if problem:
            raise ConfigError(f"--gpus {strategy.n_gpus}: {problem}; every rank needs a share, use fewer GPUs")
        return workload, strategy, precisions
    engine, rollout_gpus = rollout_setup(config, args.rollout, args.rollout_gpus)
    workload = Workload(
        **model_shapes(config, args.model, args.reward_model),
        rollout_batch=config.rl.rollout_batch,
        prompt_tokens=config.data.max_prompt_tokens,
        # An episode's response is every id after its prompt: the model's turns and the observations.
        response_tokens=config.sampling.max_new_tokens if config.env is None else config.env.max_total_tokens,
        mini_batch=config.rl.mini_batch,
        epochs=config.rl.epochs,
        steps=config.rl.steps,
        generate_batch=config.rollout.generate_batch,
        precision=precisions.for_stage(strategy.zero_stage),
        micro_batch_size=eng.micro_batch_size,
        max_tokens_per_microbatch=eng.max_tokens_per_microbatch,
        rollout_engine=engine,
        rollout_gpus=rollout_gpus,
        overlap=config.rollout.samples_ahead,
        algorithm=config.algorithm.name,
        samples_per_prompt=config.rollout.n,
        kl_in_loss=config.kl.placed_in_loss(config.algorithm.name),
        lora=lora_shape(config, "rl"),
        reference_shared=lora_shape(config, "rl") is not None and config.kl.reference == "round_start",
    )
    problem = workload.rank_shares_problem(strategy.n_gpus)
    if problem:
        raise ConfigError(f"--gpus {strategy.n_gpus}: {problem}; every rank needs a share, use fewer GPUs")
    return workload, strategy, precisions


def resolve_device(args: argparse.Namespace, config: Config) -> tuple[DeviceSpec, str]:
    """--gpu, else resources.gpu_type, else this machine's CPU (measured)."""
    book = load_price_book(args.prices)
    name = args.gpu or config.resources.gpu_type or CPU_DEVICE
    entry = book.devices.get(name, {})
    calibration = measure_cpu() if any(value is None for value in entry.values()) else None
    return device_spec(book, name, calibration), book.currency


def estimate_config(
    config: Config, device_name: str | None = None, reward_model: str | None = None
) -> tuple[Estimate, str]:
    """(estimate, currency) of a config as it stands, as `rlflow estimate CONFIG` without flags would
    give it; on `device_name` (default: resources.gpu_type, else this machine's CPU)."""
    flags = dict.fromkeys(("zero", "offload", "gpus", "rollout", "rollout_gpus", "model", "pairs"))
    args = argparse.Namespace(**flags, gpu=device_name, reward_model=reward_model, prices=str(PRICES))
    device, currency = resolve_device(args, config)
    workload, strategy, _ = build_inputs(config, args, device)
    return estimate_rl(workload, strategy, device, currency), currency


def command_estimate(args: argparse.Namespace) -> int:
    if args.max_gpus is not None and args.max_gpus < 1:
        raise ConfigError(f"--max-gpus must be at least 1, got {args.max_gpus}")
    config = read_config(args.config, args.overrides)
    device, currency = resolve_device(args, config)
    workload, strategy, precisions = build_inputs(config, args, device)
    configured = estimate_rl(workload, strategy, device, currency)
    max_gpus = args.max_gpus or max(8, strategy.n_gpus)
    advice = recommend(workload, device, currency, max_gpus, strategy, precisions)
    if args.json:
        print(json.dumps(report_json(workload, configured, advice), indent=2))
    else:
        print(report_text(workload, configured, advice))
    return 0


COMPONENT_NAMES = {
    "actor_weights": "actor weights",
    "critic_weights": "critic weights",
    "reference_weights": "reference weights",
    "reward_weights": "reward model weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "zero_gathered": "ZeRO-3 gathered params",
    "activations": "activations",
    "logits": "logits",
    "kv_cache": "KV cache",
    "rollout_server": "vLLM server (shared GPU)",
    "framework_overhead": "framework overhead",
}
PHASE_NAMES = {
    "generation": "generation",
    "scoring": "scoring forwards",
    "training": "training fwd+bwd",
    "optimizer": "optimizer steps",
    "communication": "communication",
}


def _count(n: float) -> str:
    """A parameter count in B or M, e.g. 6.74B, 0.37M."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _model_line(role: str, shape: ModelShape, params: int) -> str:
    return f"  {role:<16} {_count(params):>8} params  {shape.source}"


def _money(amount: float, currency: str) -> str:
    return f"{amount:,.2f} {currency}" if amount >= 1 else f"{amount:.4f} {currency}"


def _model_lines(w: AnyWorkload) -> list[str]:
    if isinstance(w, DPOWorkload):
        return ["models:", _model_line("policy/reference", w.actor, w.actor.lm_params)]
    lines = ["models:", _model_line("actor/reference", w.actor, w.actor.lm_params)]
    if w.critic is None:
        lines.append(f"  {'critic':<16} {'none':>8}         {w.algorithm_name} is critic-free")
    else:
        lines.append(_model_line("critic", w.critic, w.critic.scalar_params))
    if w.reward is None:
        lines.append(f"  {'reward model':<16} {'none':>8}         no learned reward source of the round")
    else:
        lines.append(_model_line("reward model", w.reward, w.reward.scalar_params))
    lines += [_model_line("reward (path)", r, r.scalar_params) for r in w.extra_rewards]
    return lines + _lora_lines(w)


def _lora_lines(w: AnyWorkload) -> list[str]:
    """What trains under model.lora, e.g. "LoRA r=16 on all-linear + embed_tokens: actor 0.11M of ..."."""
    if w.lora is None:
        return []
    what = f"LoRA r={w.lora.r} on {','.join(w.lora.targets)}" + "".join(f" + {m}" for m in w.lora.whole)
    if isinstance(w, DPOWorkload):
        return [f"  {what}: policy {_count(w.trainable_params)} trainable of {_count(w.actor.lm_params)}"]
    trained = f"actor {_count(w.actor_trainable)} of {_count(w.actor.lm_params)}"
    if w.critic is not None:
        trained += f", critic {_count(w.critic_trainable)} of {_count(w.critic_params)}"
    shared = "; the reference is the actor with adapters off (no copy)" if w.reference_shared else ""
    return [f"  {what}: {trained} trainable{shared}"]


def _workload_lines(w: AnyWorkload, device: DeviceSpec, currency: str) -> list[str]:
    rate = f"{device.peak_flops(w.precision.compute) / 1e12:.3g} TFLOP/s {w.precision.compute}"
    measured = " measured now" if device.measured else ""
    lines = [
        f"device: {device.name} ({device.memory_gib:.1f} GiB, {rate}, {device.memory_gbs:.3g} GB/s{measured};"
        f" {device.price_per_gpu_hour:g} {currency}/GPU-hour)",
        *_model_lines(w),
        f"algorithm: {w.label}",
    ]
    if isinstance(w, DPOWorkload):
        pairs = f"{w.micro_batch_size} pairs" if w.micro_batch_size else "whole rank share"
        lines.append(
            f"workload: {w.steps} steps x {w.batch_size} pairs (chosen + rejected: {2 * w.batch_size} sequences"
            f" of up to {w.seq_tokens} tokens), micro-batch {pairs}; reference pass {w.pass_pairs} pairs per forward"
        )
        return lines
    rows = f"{w.micro_batch_size} rows" if w.micro_batch_size else "whole rank share"
    lines.append(
        f"workload: {w.steps} steps x {w.rows} rows, {w.prompt_tokens} prompt + {w.response_tokens}"
        f" response tokens, mini-batch {w.mini_rows} rows, micro-batch {rows}, {w.epochs} epoch(s),"
        f" rollout {w.rollout_engine} ({w.generate_batch} rows per chunk"
        + (f", {w.rollout_gpus} dedicated GPU(s))" if w.rollout_gpus else ")")
    )
    return lines


def _estimate_lines(e: Estimate) -> list[str]:
    phases = e.memory.phases
    lines = [f"  memory per GPU (GiB) {'':<14}" + "".join(f"{p.phase:>10}" for p in phases)]
    for key, name in COMPONENT_NAMES.items():
        values = [p.components()[key] for p in phases]
        if any(values):
            lines.append(f"    {name:<30}" + "".join(f"{v / GIB:10.3f}" for v in values))
    lines.append(f"    {'total':<30}" + "".join(f"{p.total / GIB:10.3f}" for p in phases))
    peak = e.memory.peak
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines.append(
        f"  peak {peak.total / GIB:.2f} GiB/GPU in {peak.phase}; usable {e.usable_bytes / GIB:.1f} GiB"
        f" ({MEMORY_MARGIN:.0%} margin of {e.device.memory_gib:.1f}): {verdict}"
    )
    if e.memory.rollout_gpu_capacity and not e.memory.rollout_concurrency:
        lines.append(
            f"  vLLM GPU(s): cannot hold the weights and one row's KV cache ({e.memory.rollout_gpu_bytes / GIB:.1f}"
            f" > {e.memory.rollout_gpu_capacity / GIB:.1f} GiB): more --rollout-gpus (tensor parallel) needed"
        )
    elif e.memory.rollout_gpu_capacity:
        lines.append(
            f"  vLLM GPU(s): {e.memory.rollout_gpu_bytes / GIB:.1f} of {e.memory.rollout_gpu_capacity / GIB:.1f} GiB,"
            f" {e.memory.rollout_concurrency} rows decoded at once"
        )
    lines.append(f"  host RAM per node: {e.memory.cpu_ram_per_node / GIB:.2f} GiB")
    lines.append(f"  time per {e.workload.algorithm_name} step (s)")
    for key, name in PHASE_NAMES.items():
        if isinstance(e.workload, DPOWorkload) and key in ("generation", "scoring"):
            continue  # DPO samples and scores nothing per step
        lines.append(f"    {name:<30}{getattr(e.step, key):12.3f}")
    lines.append(f"    {'total':<30}{e.step.total:12.3f}")
    if e.step.overlapped:  # rollout.async / off_policy_steps with the vLLM server on GPUs of its own
        lines.append(
            f"  generation beside training: {e.step.total:.3g} s/step against {e.step.sequential:.3g} s synchronous"
            f" ({e.step.sequential / e.step.total:.2f}x)"
        )
    if e.setup_s:
        lines.append(f"  reference pass, once: {e.setup_s:.3f} s")
    lines.append(
        f"  {e.steps} steps: {e.total_hours:.3g} h x {e.gpus_billed} GPU(s) = {e.gpu_hours:.3g} GPU-hours"
        f" = {_money(e.cost, e.currency)}"
    )
    return lines


def report_text(w: AnyWorkload, configured: Estimate, advice: Recommendation) -> str:
    lines = _workload_lines(w, configured.device, configured.currency)
    lines += ["", f"as configured: {configured.strategy.label} ({w.precision.name})"]
    lines += _estimate_lines(configured)
    lines.append("")
    if advice.best is None:
        lines.append(f"recommendation: {advice.reason}")
    elif advice.best.strategy == configured.strategy and advice.best.workload == configured.workload:
        lines.append(f"recommendation: keep it - {advice.reason}")
    else:
        best = advice.best
        lines.append(f"recommendation: {advice.reason}")
        lines.append(
            f"  {best.step.total:.3g} s/step, {best.total_hours:.3g} h, {best.gpu_hours:.3g} GPU-hours,"
            f" {_money(best.cost, best.currency)}; peak {best.memory.peak.total / GIB:.1f} GiB/GPU"
        )
    lines.append(f"  ({advice.candidates} plans compared; formulas and their sources: docs/estimate.md)")
    return "\n".join(lines)


def estimate_json(e: Estimate) -> dict[str, Any]:
    return {
        "strategy": asdict(e.strategy) | {"label": e.strategy.label},
        "memory_gib": {
            p.phase: {k: v / GIB for k, v in p.components().items()} | {"total": p.total / GIB} for p in e.memory.phases
        },
        "peak_gib": e.memory.peak.total / GIB,
        "peak_phase": e.memory.peak.phase,
        "usable_gib": e.usable_bytes / GIB,
        "fits": e.fits,
        "host_ram_gib_per_node": e.memory.cpu_ram_per_node / GIB,
        "rollout_gpu_gib": e.memory.rollout_gpu_bytes / GIB,
        "rollout_concurrency": e.memory.rollout_concurrency,
        "step_seconds": asdict(e.step) | {"total": e.step.total, "sequential": e.step.sequential},
        "setup_seconds": e.setup_s,
        "steps": e.steps,
        "total_hours": e.total_hours,
        "gpus_billed": e.gpus_billed,
        "gpu_hours": e.gpu_hours,
        "cost": e.cost,
        "currency": e.currency,
    }


def report_json(w: AnyWorkload, configured: Estimate, advice: Recommendation) -> dict[str, Any]:
    return {
        "device": asdict(configured.device),
        "algorithm": w.algorithm,
        "summary": w.label,
        "workload": asdict(w),
        "configured": estimate_json(configured),
        "recommended": estimate_json(advice.best) if advice.best else None,
        "recommendation": advice.reason,
        "plans_compared": advice.candidates,
    }


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate", help="memory, time and cost of a round's RL or DPO stage before it starts, and a plan that fits"
    )
    p.add_argument("config", nargs="?", help="YAML config, e.g. configs/demo.yaml (default: the built-in defaults)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. rl.rollout_batch=512")
    p.add_argument("--model", help="policy: a local Hugging Face folder or a size like 7B, 0.5B (default: model.path)")
    p.add_argument("--reward-model", help="reward model (and critic, with ppo.critic_init=rm): folder or size")
    p.add_argument("--gpu", help="device type of the prices file (default: resources.gpu_type, else cpu)")
    p.add_argument("--gpus", type=int, help="training GPUs (default: resources.nproc_per_node x nnodes)")
    p.add_argument("--max-gpus", type=int, help="most GPUs the recommendation may use (default: max(8, --gpus))")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="0: torch backend; 1-3: DeepSpeed ZeRO stage")
    p.add_argument("--offload", choices=tuple(OFFLOADS), help="none | optimizer | all (optimizer + parameters)")
    p.add_argument("--rollout", choices=ROLLOUT_ENGINES, help="hf (generate on the training GPUs) or vllm (a server)")
    p.add_argument("--rollout-gpus", type=int, help="GPUs only the vLLM server uses (default: from placement)")
    p.add_argument("--pairs", type=int, help="DPO: preference pairs per epoch (default: counted in data.preferences)")
    p.add_argument(
        "--prices", default=str(PRICES), help="devices and prices YAML (default: configs/prices.yaml)"
    )
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    p.set_defaults(handler=command_estimate)
