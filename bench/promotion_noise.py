"""How often the promotion gates reject a candidate that is no worse than its start.

    python bench/promotion_noise.py RUN [--root runs] [--round 0] [--draws 20]

RUN is a finished run of the demo (or any config with promotion gates); its round's SFT policy is
both the start and the candidate, evaluated as the round's evaluation stage does (the same prompts,
gold, sampling and batch size). Two cases:
  identical  the same weights and the same sampling seed: what the flow compares when a round left
             its policy unchanged (every change is exactly 0);
  resampled  the same weights, start and candidate each sampled with a seed of its own per draw: a
             candidate of equal quality whose answers differ from the start's by sampling noise
             only (more than a retrained candidate sampled with the round's one seed would), the
             false-reject rate the gates' thresholds must keep low.
Each draw is decided by the run's promotion.gates plus two z-gates (valid_drop_z max 2, gold_gain_z
min -2); writes bench/results/promotion_noise-<UTC stamp>.json with each draw's numbers.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rlflow.engine.config.promotion import PromotionGate
from rlflow.engine.data.records import load_prompts
from rlflow.engine.models.loading import load_policy, load_tokenizer
from rlflow.engine.promotion.gates import decide_promotion
from rlflow.engine.rewards.model_scores import ScoringModels
from rlflow.engine.rewards.user_functions import load_bound_function
from rlflow.engine.seeds import step_seed
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.stages.evaluation import evaluate_policy
from rlflow.engine.stages.round_eval import paired_metrics
from rlflow.engine.storage.checkpoint import CheckpointStore, model_location, stage_prefix
from rlflow.flows.plan import load_run_config

Z_GATES = [PromotionGate(metric="valid_drop_z", max=2.0), PromotionGate(metric="gold_gain_z", min=-2.0)]


def summary_row(before, after) -> dict[str, float]:
    """What flows/rounds.py puts in a round's row, for the gates."""
    b, a = before.metrics, after.metrics
    paired = {k.removeprefix("eval/"): v for k, v in paired_metrics(before, after).items()}
    return paired | {
        "gold_score_before": b["eval/gold_score"],
        "gold_score_after": a["eval/gold_score"],
        "valid_fraction_before": b["eval/valid_fraction"],
        "valid_fraction": a["eval/valid_fraction"],
        "distinct_2_before": b["eval/distinct_2"],
        "distinct_2": a["eval/distinct_2"],
        "response_length_before": b["eval/response_length"],
        "response_length": a["eval/response_length"],
        "kl": a["eval/kl"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    parser.add_argument("--root", default="runs")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--draws", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    cfg = load_run_config(args.root, args.run)
    store = CheckpointStore(stage_prefix(cfg.run.root, cfg.run.name, args.round, "sft"), cfg.run.storage_options)
    final = store.final()
    if final is None:
        raise SystemExit(f"round {args.round} of {args.run} has no finished SFT stage ({store.url})")
    path = model_location(store.step_url(final["step"]), cfg.run.storage_options)
    kw = {"dtype": cfg.model.dtype, "trust_remote_code": cfg.model.trust_remote_code}
    tokenizer = load_tokenizer(path, cfg.model.trust_remote_code, chat_template=cfg.data.chat_template)
    policy = load_policy(path, **kw).eval()
    gold = load_bound_function(cfg.gold, "gold.fn")
    scoring = ScoringModels(reward_model=None, score_norm=None, reference=policy, sft=policy, gold=gold)
    records = load_prompts(cfg.data.eval_prompts, cfg.data.storage_options)[: cfg.eval.num_prompts]
    prompts, _, _ = encode_prompt_set(
        tokenizer, records, cfg.data.max_prompt_tokens, cfg.data.prompt_overflow, cfg.data.eval_prompts
    )
    sampling = cfg.sampling.params(greedy=cfg.eval.greedy)
    seed = step_seed(cfg.run.seed, args.round, 10)  # the round's evaluation seed

    def measure(s: int):
        return evaluate_policy(policy, tokenizer, prompts, scoring, sampling, s, cfg.eval.batch_size, 0)

    gates = [*cfg.promotion.gates, *Z_GATES]
    started = time.monotonic()
    # Each resampled draw samples its start and its candidate with seeds of its own: the draws are
    # independent (one shared start would make every draw inherit that start's luck).
    draws = [("identical", seed, seed)]
    draws += [("resampled", seed + 1000 * (2 * d + 1), seed + 1000 * (2 * d + 2)) for d in range(args.draws)]
    results = []
    for case, start_seed, candidate_seed in draws:
        start = measure(start_seed)
        row = summary_row(start, start if candidate_seed == start_seed else measure(candidate_seed))
        decision = decide_promotion(row, gates)
        failed = [g.metric for g in decision.failed]
        results.append({"case": case, "seeds": [start_seed, candidate_seed], "promoted": decision.promoted} | row)
        results[-1]["failed"] = failed
        verdict = "promoted" if decision.promoted else "REJECTED " + ",".join(failed)
        numbers = f"valid_drop {row['valid_drop']:+.3f} (se {row['valid_drop_stderr']:.3f})"
        numbers += f"  gold_gain {row['gold_gain']:+.3f} (se {row['gold_gain_stderr']:.3f})"
        print(f"{case:9}: {verdict:28} {numbers}", flush=True)
    resampled = [r for r in results if r["case"] == "resampled"]
    per_gate = {g.metric: sum(g.metric in r["failed"] for r in resampled) / len(resampled) for g in gates}
    report = {
        "run": args.run,
        "round": args.round,
        "policy": path,
        "n_prompts": len(prompts.token_ids),
        "gates": [g.model_dump() for g in gates],
        "false_reject_rate_resampled": sum(not r["promoted"] for r in resampled) / len(resampled),
        "reject_rate_per_gate_resampled": per_gate,
        "identical_promoted": results[0]["promoted"],
        "seconds": round(time.monotonic() - started, 1),
        "draws": results,
    }
    out = Path("bench/results") / f"promotion_noise-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "draws"}, indent=2))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
