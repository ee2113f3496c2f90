"""One repetition of TRL 1.12's PPO (trl.experimental.ppo) for bench/ppo_vs_trl.py, in its own process.

    PYTHONPATH=.bench/trl python bench/trl_ppo_worker.py '<workload JSON>'   # normally started by ppo_vs_trl.py

Runs PPOTrainer.train() for warmup + updates iterations on the same models, prompts and settings as the
rlflow worker, and times each iteration (generation + scoring + update) between on_step_end callbacks,
handling other jobs on the machine as the rlflow worker does. TRL is never a project dependency: it
lives in .bench/trl (see the Makefile's bench target).
Prints one line `BENCH_JSON {...}` on stdout.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch
from transformers import TrainerCallback

from bench_assets import cpu_snapshot, emit_result, foreign_cores, prompt_ids, wait_quiet


class IterationClock(TrainerCallback):
    """PPOTrainer.train() calls on_train_begin once, then on_step_end once per iteration (after the
    optimizer and scheduler steps, before its per-iteration cleanup). An iteration is timed from the
    previous call's return to this call: that is one full iteration, the previous one's cleanup
    included, as in a steady-state loop. After an iteration other jobs disturbed (from the warm-up on)
    the clock waits for them to leave the cores, outside any timed interval, as the rlflow worker does."""

    def __init__(self, warmup: int, quiet_s: float):
        self.warmup, self.quiet_s = warmup, quiet_s
        self.intervals: list[tuple[tuple, tuple]] = []  # (start, end) cpu snapshots
        self.waited: list[float] = []
        self.threads_at_start = 0
        self._start: tuple | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.threads_at_start = torch.get_num_threads()
        self._start = cpu_snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        self.intervals.append((self._start, cpu_snapshot()))
        if self.warmup <= state.global_step < state.max_steps:
            self.waited.append(wait_quiet(self.quiet_s, foreign_cores(*self.intervals[-1])))
        self._start = cpu_snapshot()


def timed_iterations(run: dict, warmup: int) -> dict:
    """The result fields both TRL workers report from their IterationClock and run: the timed iterations'
    seconds and foreign cores, the warm-up's seconds, the threads, TRL's own settings and versions."""
    iterations = [end[0] - start[0] for start, end in run["intervals"]]
    foreign = [foreign_cores(start, end) for start, end in run["intervals"]]
    plain = (int, float, bool, type(None))
    return {
        "side": "trl",
        "update_s": iterations[warmup:],
        "foreign_cores": foreign[warmup:],
        "quiet_wait_s": run["quiet_wait_s"],
        "warmup_s": iterations[:warmup],
        "gen_s": [g["seconds"] for g in run["generations"][warmup:]],
        "threads": run["threads"],
        "config": {k: v if isinstance(v, plain) else str(v) for k, v in run["config"].items()},
        "trl_version": run["trl_version"],
        "datasets_version": run["datasets_version"],
    }


def train_and_collect(trainer, work: dict, clock: IterationClock, logs: "LogKeeper", settings: tuple) -> dict:
    """Run trainer.train() with its per-step prints off and the workload's threads; returns what both TRL
    workers report of the run: the clock's intervals and waits, the logs, the `settings` TRL resolved."""
    import datasets
    import trl
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for noisy in (PrinterCallback, ProgressCallback):  # per-step prints on stdout
        trainer.remove_callback(noisy)
    torch.set_num_threads(work["threads"])  # in case Accelerate's setup changed it
    trainer.train()
    return {
        "intervals": clock.intervals,
        "quiet_wait_s": clock.waited,
        "logs": logs.logs,
        "threads": clock.threads_at_start,
        "config": {k: getattr(trainer.args, k) for k in settings},
        "trl_version": trl.__version__,
        "datasets_version": datasets.__version__,
    }


class LogKeeper(TrainerCallback):
    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def watch_generation(ppo_module, record: list[dict]) -> None:
    """Wrap TRL's module-level batch_generation (train() looks it up by name at each call) to time the
    sampling phase and to see the responses: their width proves every one is full-length."""
    inner = ppo_module.batch_generation

    def batch_generation(model, queries, batch, pad_token_id, generation_config):
        started = time.perf_counter()
        query_responses, logits = inner(model, queries, batch, pad_token_id, generation_config)
        responses = query_responses[:, queries.shape[1] :]
        record.append(
            {
                "seconds": time.perf_counter() - started,
                "response_width": responses.shape[1],
                # TRL ends a response at its first pad token (pad = an in-range id the model may sample);
                # the tensors, and so the compute, stay full width.
                "rows_with_sampled_pad": int((responses == pad_token_id).any(1).sum()),
            }
        )
        return query_responses, logits

    ppo_module.batch_generation = batch_generation


# The Hugging Face Trainer settings both TRL workers pin to rlflow's (trainer_args) and report.
TRAINER_SETTINGS_REPORTED = (
    "learning_rate",
    "optim",
    "lr_scheduler_type",
    "adam_beta1",
    "adam_beta2",
    "weight_decay",
    "max_grad_norm",
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "use_cpu",
    "save_strategy",
)
TRL_SETTINGS_REPORTED = (
    "batch_size",
    "mini_batch_size",
    "local_rollout_forward_batch_size",
    "num_ppo_epochs",
    "num_mini_batches",
    "gradient_accumulation_steps",
    "response_length",
    "temperature",
    "kl_coef",
    "kl_estimator",
    "whiten_rewards",
    "cliprange",
    "cliprange_value",
    "vf_coef",
    "gamma",
    "lam",
    "num_total_batches",
    "total_episodes",
    "num_sample_generations",
) + TRAINER_SETTINGS_REPORTED


def trainer_args(work: dict, output_dir: str) -> dict:
    """The Trainer arguments both TRL workers share: rlflow's optimizer and schedule (AdamW, betas
    (0.9, 0.95), no weight decay, a constant learning rate), fp32 on the CPU, no checkpoints, no
    evaluation, no reporting, a log entry per step, the workload's seed."""
    return dict(
        output_dir=output_dir,
        learning_rate=work["lr"],
        lr_scheduler_type="constant",
        adam_beta2=0.95,
        weight_decay=0.0,
        gradient_checkpointing=False,  # TRL's default is True; rlflow's is off
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        dataloader_num_workers=0,
        seed=work["seed"],
    )


def make_config(work: dict, output_dir: str):
    from trl.experimental.ppo import PPOConfig

    batch = work["batch"]
    return PPOConfig(
        **trainer_args(work, output_dir),
        total_episodes=batch * (work["warmup"] + work["updates"]),  # one iteration = one batch
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=1,
        local_rollout_forward_batch_size=batch,
        response_length=work["max_new_tokens"],
        stop_token=None,
        missing_eos_penalty=None,
        temperature=1.0,
        kl_coef=work["kl_coef"],
        kl_estimator="k1",  # rlflow's default estimator too
        whiten_rewards=False,
        max_grad_norm=1.0,  # accepted, but TRL's PPO loop never clips (see the orchestrator's notes)
        num_sample_generations=0,
    )


def run_trl(work: dict) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    tokenizer = AutoTokenizer.from_pretrained(work["policy"])
    tokenizer.padding_side = "left"
    ids = prompt_ids(tokenizer, work["prompts"], work["batch"], work["max_prompt_tokens"])
    dataset = datasets.Dataset.from_dict({"input_ids": ids})
    fp32 = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(work["policy"], **fp32)
    reference = AutoModelForCausalLM.from_pretrained(work["policy"], **fp32)
    reward = AutoModelForSequenceClassification.from_pretrained(work["rm"], num_labels=1, **fp32)
    critic = AutoModelForSequenceClassification.from_pretrained(work["rm"], num_labels=1, **fp32)
    clock, logs, generations = IterationClock(work["warmup"], work["quiet_s"]), LogKeeper(), []
    watch_generation(ppo_module, generations)
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as out:
        trainer = PPOTrainer(
            args=make_config(work, out),
            processing_class=tokenizer,
            model=policy,
            ref_model=reference,
            reward_model=reward,
            train_dataset=dataset,
            value_model=critic,
            callbacks=[clock, logs],
        )
        run = train_and_collect(trainer, work, clock, logs, TRL_SETTINGS_REPORTED)
    return run | {"generations": generations, "prompt_ids": ids}


def main() -> None:
    work = json.loads(sys.argv[1])
    torch.set_num_threads(work["threads"])
    torch.manual_seed(work["seed"])
    run = run_trl(work)
    n = work["warmup"] + work["updates"]
    if len(run["intervals"]) != n or len(run["generations"]) != n:
        counts = f"{len(run['intervals'])} iterations ({len(run['generations'])} generations)"
        raise SystemExit(f"TRL ran {counts}, expected {n}")
    for i, gen in enumerate(run["generations"]):
        if gen["response_width"] != work["max_new_tokens"]:
            raise SystemExit(f"iteration {i + 1}: responses {gen['response_width']} wide, not {work['max_new_tokens']}")
    for i, log in enumerate(run["logs"]):
        if log.get("val/num_eos_tokens", 0) != 0:
            raise SystemExit(f"iteration {i + 1}: TRL saw {log['val/num_eos_tokens']} EOS tokens")
    result = timed_iterations(run, work["warmup"]) | {
        "response_width": [g["response_width"] for g in run["generations"]],
        "rows_with_sampled_pad": [g["rows_with_sampled_pad"] for g in run["generations"]],
        "num_eos_tokens": [log.get("val/num_eos_tokens") for log in run["logs"]],
    }
    emit_result(work, run["prompt_ids"], result)


if __name__ == "__main__":
    main()
