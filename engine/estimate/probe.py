"""Measure an RL configuration (algorithm.name ppo, grpo, rloo or reinforce_pp) for a few steps
before committing to a run: memory, step time, throughput, and where reward and KL are heading.
Writes nothing: no checkpoints, no models. The steps are the RL stage's own: they are opened by the
RL-run entry point (engine/stages/rl/run.py) from the stage's inputs record, so the probe runs the
algorithm's objective, rollout.n samples per prompt, no critic for a critic-free algorithm, the
reward.sources (rules and functions in their worker pool) and, with an `env`, multi-turn episodes.

Memory is the process's peak resident set above its resident set once everything is imported
(the number `rlflow estimate` predicts on a CPU), and on a GPU torch's peak allocation.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from rlflow.engine.backend.runtime import Runtime
from rlflow.engine.stages.rl.inputs import RLInputs
from rlflow.engine.stages.rl.run import RLRun


@dataclass(frozen=True)
class ProbeStep:
    step: int
    seconds: float
    generated_tokens: int  # response tokens sampled this step (all prompts x rollout.n samples)
    processed_tokens: int  # prompt + response tokens of the batch
    reward: float  # critic/score/mean: mean score, the weighted sum of the reward sources
    kl: float  # actor/kl: rollout KL to the reference, nats per token
    timings: dict[str, float]  # the step's timing_s/* phases
    turns: float | None = None  # env/turns: model turns per episode (mean), with an env; None: single-turn


@dataclass(frozen=True)
class ProbeReport:
    steps: tuple[ProbeStep, ...]
    load_seconds: float  # loading the models, starting the reward pool, encoding the prompts
    baseline_rss: int  # bytes resident after imports, before any model is loaded
    peak_rss: int  # bytes: the process's peak resident set
    gpu_peak_allocated: int | None  # bytes torch allocated at most on the GPU; None on a CPU
    longest_prompt: int  # tokens of the longest encoded prompt (what batches are padded to, at most)
    episodes: bool = False  # each prompt was a multi-turn episode of the config's env

    @property
    def peak_rss_above_baseline(self) -> int:
        return self.peak_rss - self.baseline_rss

    @property
    def timed(self) -> tuple[ProbeStep, ...]:
        """The steps that count for timing: all but the first, which pays one-off costs (lazy
        optimizer state, kernel selection for new shapes), unless it is the only one."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    def step_seconds(self) -> dict[str, float]:
        """mean, p50 and p90 seconds per step over the timed steps."""
        seconds = sorted(s.seconds for s in self.timed)
        p90 = seconds[min(len(seconds) - 1, round(0.9 * (len(seconds) - 1)))]
        return {"mean": statistics.fmean(seconds), "p50": statistics.median(seconds), "p90": p90}

    def tokens_per_second(self) -> dict[str, float]:
        """Generated and processed (prompt + response) tokens per second over the timed steps."""
        seconds = sum(s.seconds for s in self.timed)
        return {
            "generated": sum(s.generated_tokens for s in self.timed) / seconds,
            "processed": sum(s.processed_tokens for s in self.timed) / seconds,
        }

    def phase_seconds(self) -> dict[str, float]:
        """Median seconds per step of each timing_s/* phase over the timed steps."""
        keys = sorted({k for s in self.timed for k in s.timings})
        return {k: statistics.median(s.timings.get(k, 0.0) for s in self.timed) for k in keys}

    def trends(self) -> dict[str, float]:
        """Least-squares slope per step of the reward and the KL over all probed steps."""
        xs = [float(s.step) for s in self.steps]
        return {
            "reward_per_step": least_squares_slope(xs, [s.reward for s in self.steps]),
            "kl_per_step": least_squares_slope(xs, [s.kl for s in self.steps]),
        }


def least_squares_slope(xs: list[float], ys: list[float]) -> float:
    """Slope of the least-squares line through (xs, ys); 0 for fewer than two points."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def resident_bytes() -> int:
    """The process's resident set now (Linux /proc; elsewhere the peak is the best there is)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM, of its own address space. Not ru_maxrss, which
    execve carries over from the parent (a probe started by a 3 GiB process reported >= 3 GiB; seen as
    a probe 1.29x its estimate when the test's pytest worker had held SmolLM2 before)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def preload_model_code(path: str, trust_remote_code: bool) -> None:
    """Import the model's modelling code now, so the baseline holds code and only the probe's
    tensors count above it (transformers imports an architecture's module on first use)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for name in (*(config.architectures or ()), "AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        getattr(transformers, name, None)  # a lazy attribute: getting it imports its module


def run_probe(
    inputs: RLInputs,
    runtime: Runtime,
    steps: int,
    on_step: Callable[[ProbeStep], None] = lambda step: None,
) -> ProbeReport:
    """`steps` RL steps of the stage `inputs` describes, opened as the stage opens them (no
    evaluation, no checkpoint). Call it in a process that has imported what it needs: the baseline is
    taken on entry, the peak is the process's lifetime peak (reward worker processes are not in it)."""
    preload_model_code(inputs.upstream.policy.uri, inputs.model.trust_remote_code)
    if inputs.model.lora is not None:
        import peft  # noqa: F401  # code, not tensors: ~160 MB resident on import, before the baseline
    baseline = resident_bytes()
    if runtime.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runtime.device)
    started, done = time.monotonic(), []
    with RLRun.open(runtime, inputs) as run:
        load_seconds = time.monotonic() - started
        rows = inputs.rl.rollout_batch * inputs.rollout.n
        for step in range(1, steps + 1):
            done.append(_probe_step(step, run.step(step), rows))
            on_step(done[-1])
    gpu_peak = torch.cuda.max_memory_allocated(runtime.device) if runtime.device.type == "cuda" else None
    longest = max(len(p) for p in run.prompts.token_ids)
    peak = peak_resident_bytes()
    return ProbeReport(tuple(done), load_seconds, baseline, peak, gpu_peak, longest, inputs.env is not None)


def _probe_step(step: int, metrics: dict[str, float], rows: int) -> ProbeStep:
    """One step's ProbeStep from an RL step's metrics; `rows`: samples in the step (prompts x n)."""
    return ProbeStep(
        step=step,
        seconds=metrics["timing_s/step"],
        generated_tokens=round(metrics["response_length/mean"] * rows),
        processed_tokens=round(metrics["perf/throughput"] * metrics["timing_s/step"]),
        reward=metrics["critic/score/mean"],
        kl=metrics["actor/kl"],
        timings={k: v for k, v in metrics.items() if k.startswith("timing_s/")},
        turns=metrics.get("env/turns"),
    )
