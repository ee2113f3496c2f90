"""Whether a reward-model ensemble's spread flags the RL policy's hacked answers.

    python bench/ensemble_spread.py RUN [--root runs] [--round 0] [--members]

RUN is a finished run with `rm.ensemble >= 2`. The round's RL policy answers the evaluation prompts
once (the round's evaluation seed); each answer is scored by the round's reward model, every head
normalised by its own reference statistics, and labelled valid or not by the gold's `valid`
component (read here to judge the spread; nothing in training reads it). Reports the heads' mean
std on valid and on invalid answers, the AUC (the chance that a random invalid answer has a larger
std than a random valid one; 0.5: the spread says nothing), and the ensemble's mean score of each.
--members also trains H independent reward models (one backbone each, on the same H bootstrap
resamples, with the stage's own training step) and reports the same for them. Writes
bench/results/ensemble_spread-<UTC stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from rlflow.engine.backend.runtime import OptimSpec, Runtime
from rlflow.engine.data.batching import bootstrap_weights, encode_pair
from rlflow.engine.data.records import load_preference_pairs, load_prompts, load_sft_examples
from rlflow.engine.models.loading import load_policy, load_scalar_model, load_tokenizer
from rlflow.engine.rewards.model_scores import normalised_head_scores
from rlflow.engine.rewards.user_functions import load_bound_function, score_answers
from rlflow.engine.rollout.generate import generate_rollouts
from rlflow.engine.seeds import step_seed
from rlflow.engine.stages.context import StageContext
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.stages.reward_model import _pair_rows, rm_train_step, score_statistics
from rlflow.engine.storage.checkpoint import CheckpointStore, model_location, stage_prefix
from rlflow.flows.plan import load_run_config


def final_model(cfg, round_index: int, stage: str) -> str:
    store = CheckpointStore(stage_prefix(cfg.run.root, cfg.run.name, round_index, stage), cfg.run.storage_options)
    final = store.final()
    if final is None:
        raise SystemExit(f"round {round_index} of {cfg.run.name} has no finished {stage} stage ({store.url})")
    return model_location(store.step_url(final["step"]), cfg.run.storage_options)


def auc(spread: torch.Tensor, valid: torch.Tensor) -> float:
    """P(spread of a random invalid answer > that of a random valid one), ties counted half."""
    invalid, ok = spread[valid == 0], spread[valid == 1]
    if not len(invalid) or not len(ok):
        return float("nan")
    above = (invalid[:, None] > ok[None, :]).float().mean()
    return float(above + 0.5 * (invalid[:, None] == ok[None, :]).float().mean())


def describe(scores: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """scores [N, H] normalised per head; valid [N] 0/1."""
    std, mean = scores.std(1), scores.mean(1)
    return {
        "std_valid": float(std[valid == 1].mean()),
        "std_invalid": float(std[valid == 0].mean()) if (valid == 0).any() else float("nan"),
        "auc_invalid_higher_std": auc(std, valid),
        "mean_score_valid": float(mean[valid == 1].mean()),
        "mean_score_invalid": float(mean[valid == 0].mean()) if (valid == 0).any() else float("nan"),
    }


def train_members(cfg, sft_dir: str, tokenizer, heads: int, root: str) -> list[torch.nn.Module]:
    """H one-head reward models trained apart, member h on bootstrap resample h (the stage's weights)."""
    pad, data = tokenizer.pad_token_id, cfg.data
    pairs = list(load_preference_pairs(data.preferences, data.storage_options))
    rows = _pair_rows(tokenizer, pairs, cfg.rm.max_seq_tokens)
    weights = bootstrap_weights(len(rows), heads, cfg.run.seed, 0, 3)
    steps = cfg.rm.epochs * math.ceil(len(rows) / cfg.rm.batch_size)
    members = []
    for h in range(heads):
        runtime = Runtime(cfg.engine)

        def load():
            model = load_scalar_model(sft_dir)
            model.config.pad_token_id = pad
            return model

        optim = OptimSpec(cfg.rm.lr, cfg.rm.weight_decay, cfg.rm.warmup_steps, steps, cfg.rm.max_grad_norm)
        engine = runtime.trainable("model", load, optim)
        engine.train()
        ctx = StageContext(CheckpointStore(f"{root}/member_{h}"), "rm", 0, cfg.run.seed + 1 + h, "m", {})
        for step in range(1, steps + 1):
            rm_train_step(engine, runtime, rows, weights[:, h : h + 1], pad, cfg.rm.batch_size, step, ctx)
        members.append(engine.model.eval())
    return members


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--root", default="runs")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--members", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.monotonic()
    cfg = load_run_config(args.root, args.run)
    sft_dir, rm_dir, policy_dir = (final_model(cfg, args.round, s) for s in ("sft", "rm", "ppo"))
    tokenizer = load_tokenizer(sft_dir, cfg.model.trust_remote_code, chat_template=cfg.data.chat_template)
    pad = tokenizer.pad_token_id
    reference = [
        encode_pair(tokenizer, ex.prompt, ex.response, cfg.rm.max_seq_tokens, ex.tools)
        for ex in load_sft_examples(cfg.data.sft, cfg.data.storage_options)[: cfg.rm.norm_samples]
    ]
    records = load_prompts(cfg.data.eval_prompts, cfg.data.storage_options)[: cfg.eval.num_prompts]
    prompts, _, _ = encode_prompt_set(
        tokenizer, records, cfg.data.max_prompt_tokens, cfg.data.prompt_overflow, cfg.data.eval_prompts
    )
    policy = load_policy(policy_dir).eval()
    sampling = cfg.sampling.params(greedy=cfg.eval.greedy)
    batch = generate_rollouts(policy, tokenizer, prompts.token_ids, sampling, step_seed(cfg.run.seed, args.round, 10))
    gold = load_bound_function(cfg.gold, "gold.fn")
    texts = list(batch.response_texts)
    scored = score_answers(gold, [r.prompt for r in prompts.records], texts, [r.fields for r in prompts.records])
    valid = torch.tensor([float(v) for v in scored.components["valid"]])

    def normalised(model) -> torch.Tensor:  # [N, H], each head by its own reference statistics
        return normalised_head_scores(model, batch, score_statistics(model, reference, pad))

    rm = load_scalar_model(rm_dir).eval()
    heads = normalised(rm)
    if heads.shape[1] < 2:
        raise SystemExit(f"{args.run}'s reward model has one head; run it with rm.ensemble=4")
    report = {"run": args.run, "round": args.round, "answers": len(texts), "valid_share": float(valid.mean())}
    report["heads"] = describe(heads, valid)
    if args.members:
        members = train_members(cfg, sft_dir, tokenizer, heads.shape[1], f"/tmp/rlflow-members-{args.run}")
        report["members"] = describe(torch.cat([normalised(m) for m in members], 1), valid)
    report["seconds"] = round(time.monotonic() - started, 1)
    out = Path("bench/results") / f"ensemble_spread-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
