"""One repetition of TRL 1.12's GRPO (trl.GRPOTrainer) for bench/ppo_vs_trl.py (--algos grpo), in its own process.

    PYTHONPATH=.bench/trl python bench/trl_grpo_worker.py '<workload JSON>'   # normally started by ppo_vs_trl.py

Runs GRPOTrainer.train() for warmup + updates iterations on the same models, prompts and settings as the
rlflow GRPO worker, and times each iteration (generation + scoring + update) between on_step_end callbacks,
handling other jobs on the machine as the PPO workers do (trl_ppo_worker.IterationClock). The reward is a
function wrapping the same reward-model folder, scoring exactly the sampled token ids (see reward_function).
Prints one line `BENCH_JSON {...}` on stdout.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

from bench_assets import emit_result, prompt_ids
from trl_ppo_worker import (
    TRAINER_SETTINGS_REPORTED,
    IterationClock,
    LogKeeper,
    timed_iterations,
    train_and_collect,
    trainer_args,
)

TRL_SETTINGS_REPORTED = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "num_iterations",
    "max_completion_length",
    "temperature",
    "top_p",
    "top_k",
    "beta",
    "epsilon",
    "loss_type",
    "scale_rewards",
    "max_steps",
    "shuffle_dataset",
) + TRAINER_SETTINGS_REPORTED


def make_config(work: dict, output_dir: str):
    """One optimizer step per iteration over the whole batch: per-device batch = prompts x generations rows,
    no accumulation, one generation per step (steps_per_generation defaults to the accumulation, 1)."""
    from trl import GRPOConfig

    return GRPOConfig(
        **trainer_args(work, output_dir),
        max_steps=work["warmup"] + work["updates"],
        per_device_train_batch_size=work["prompts_per_iter"] * work["generations"],
        gradient_accumulation_steps=1,
        num_generations=work["generations"],
        num_iterations=1,
        max_completion_length=work["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,  # no top-k filtering (rlflow samples the full distribution too)
        beta=work["beta"],  # KL to the reference as a loss term; TRL's estimator is k3
        loss_type=work["trl_loss_type"],  # "dapo": token-mean over the step's batch = rlflow's token-mean
        scale_rewards="group",  # (r - group mean) / group std, as rlflow's grpo with norm_std
        warmup_steps=0,
        max_grad_norm=1.0,  # the HF Trainer loop clips, as rlflow does
    )


def reward_function(model, pad_id: int, record: list[dict]):
    """The reward model as a TRL reward function that scores the sampled token ids themselves: the row's
    prompt ids (left-padded to the batch's widest) then its completion ids, one forward over the batch, the
    score read at the last attended token. That is rlflow's reward pass token for token; TRL's own
    model-reward path would decode the texts and re-tokenize them, which for the bench tokenizer does not
    give back the same ids (and so not the same work)."""

    def rm(prompts, completions, completion_ids, bench_prompt_ids, **_):
        started = time.perf_counter()
        width = max(len(p) for p in bench_prompt_ids)
        length = max(len(c) for c in completion_ids)
        rows, masks = [], []
        for p, c in zip(bench_prompt_ids, completion_ids, strict=True):
            left, right = width - len(p), length - len(c)
            rows.append([pad_id] * left + list(p) + list(c) + [pad_id] * right)
            masks.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        ids, mask = torch.tensor(rows), torch.tensor(masks)
        with torch.inference_mode():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
            values = model.score(hidden).squeeze(-1)
            last = (mask * torch.arange(mask.shape[1])).argmax(-1)
            scores = values.gather(1, last[:, None]).squeeze(1)
        record.append({"seconds": time.perf_counter() - started, "width": ids.shape[1]})
        return scores.tolist()

    return rm


def watch_generation(trainer, record: list[dict]) -> None:
    """Wrap the trainer's transformers-generate path to time the sampling phase and see what it sampled:
    the completions' lengths prove every one is full-length, the prompt ids that both sides drew the same."""
    inner = trainer._generate_single_turn

    def generate_single_turn(prompt_ids, *args, **kwargs):
        started = time.perf_counter()
        completion_ids, logprobs = inner(prompt_ids, *args, **kwargs)
        lengths = [len(c) for c in completion_ids]
        record.append(
            {
                "seconds": time.perf_counter() - started,
                "rows": len(completion_ids),
                "min_length": min(lengths),
                "max_length": max(lengths),
                "prompt_ids": sorted(list(p) for p in prompt_ids),
            }
        )
        return completion_ids, logprobs

    trainer._generate_single_turn = generate_single_turn


def run_trl(work: dict) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(work["policy"])
    tokenizer.padding_side = "left"
    ids = prompt_ids(tokenizer, work["prompts"], work["prompts_per_iter"], work["max_prompt_tokens"])
    with open(work["prompts"]) as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()][: work["prompts_per_iter"]]
    dataset = datasets.Dataset.from_dict({"prompt": texts, "bench_prompt_ids": ids})
    fp32 = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(work["policy"], **fp32)
    reward = AutoModelForSequenceClassification.from_pretrained(work["rm"], num_labels=1, **fp32).eval()
    clock, logs, generations, rewards = IterationClock(work["warmup"], work["quiet_s"]), LogKeeper(), [], []
    with tempfile.TemporaryDirectory(prefix="trl-grpo-bench-") as out:
        trainer = GRPOTrainer(  # the reference: TRL loads it from the policy's folder itself (fp32, as beta > 0)
            model=policy,
            reward_funcs=reward_function(reward, tokenizer.pad_token_id, rewards),
            args=make_config(work, out),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[clock, logs],
        )
        watch_generation(trainer, generations)
        run = train_and_collect(trainer, work, clock, logs, TRL_SETTINGS_REPORTED)
    ref_dtype = str(next(trainer.ref_model.parameters()).dtype)
    return run | {"generations": generations, "rewards": rewards, "prompt_ids": ids, "ref_dtype": ref_dtype}


def check(work: dict, run: dict) -> None:
    """Stop if TRL did not run the workload: the iteration count, full-length completions, the same
    prompts (each `generations` times) as the rlflow side, an fp32 reference."""
    n, new = work["warmup"] + work["updates"], work["max_new_tokens"]
    if len(run["intervals"]) != n or len(run["generations"]) != n or len(run["rewards"]) != n:
        counts = (len(run["intervals"]), len(run["generations"]), len(run["rewards"]))
        raise SystemExit(f"TRL ran (iterations, generations, reward calls) {counts}, expected {n} each")
    expected = sorted(list(p) for p in run["prompt_ids"] for _ in range(work["generations"]))
    for i, gen in enumerate(run["generations"]):
        if gen["min_length"] != new or gen["max_length"] != new:
            raise SystemExit(f"iteration {i + 1}: completions {gen['min_length']}-{gen['max_length']} long, not {new}")
        if gen["prompt_ids"] != expected:
            raise SystemExit(f"iteration {i + 1}: TRL sampled other prompts than the bench's {len(expected)} rows")
    for i, log in enumerate(run["logs"]):
        if "completions/mean_length" in log and log["completions/mean_length"] != new:
            raise SystemExit(f"iteration {i + 1}: TRL logged completions/mean_length {log['completions/mean_length']}")
    if run["ref_dtype"] != "torch.float32":
        raise SystemExit(f"TRL's reference model is {run['ref_dtype']}, not fp32")


def main() -> None:
    work = json.loads(sys.argv[1])
    torch.set_num_threads(work["threads"])
    torch.manual_seed(work["seed"])
    run = run_trl(work)
    check(work, run)
    result = timed_iterations(run, work["warmup"]) | {
        "algo": "grpo",
        "reward_s": [r["seconds"] for r in run["rewards"][work["warmup"] :]],
        "kl": [log.get("kl") for log in run["logs"] if "kl" in log],
        "grad_norm": [log.get("grad_norm") for log in run["logs"] if "grad_norm" in log],
    }
    emit_result(work, run["prompt_ids"], result)


if __name__ == "__main__":
    main()
