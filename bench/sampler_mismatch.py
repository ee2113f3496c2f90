"""The log-prob gap between each sampler and the fp32 trainer, on the same prompts (`make bench`).

    python bench/sampler_mismatch.py [--model DIR] [--prompts 64] [--new-tokens 32] [--temperature 1.0]

Each sampler (the HF replica and a vLLM replica, each in float32 and bfloat16, one core each, in turn)
samples the same chat prompts from the same weights; the fp32 trainer rescores every sampled token at
the same temperature. Per sampler: rollout/logprob_diff_mean and _max (|trainer - sampler| in nats over
the response tokens, what the sync guard checks), their 99th percentile, and rollout/mismatch_kl (the
k3 estimate of KL(sampler || trainer) per token, what TIS/MIS correct). The defaults of
rollout.max_logprob_diff (LOGPROB_DIFF_STOPS) are set from this table. Writes
bench/results/mismatch-<UTC time>.json, and last
    RESULT diff_max_hf_float32=<nats> ... mismatch_kl_vllm_bfloat16=<nats>
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

SAMPLERS = (("hf", "float32"), ("hf", "bfloat16"), ("vllm", "float32"), ("vllm", "bfloat16"))


def gap(tokenizer, policy, prompts, generation, params) -> dict[str, float]:
    """The guard's and the correction's figures of one sampler's generation against the trainer."""
    import torch

    from rlflow.engine.algorithms.rollout_correction import correction_metrics, raw_importance_weights
    from rlflow.engine.rollout.generate import batched_logprobs
    from rlflow.engine.rollout.served import build_rollout_batch

    batch = build_rollout_batch(tokenizer, prompts, generation, params.max_new_tokens)
    with torch.no_grad():
        trainer = batched_logprobs(policy, batch, params.temperature)
    mask = batch.response_mask
    diff = (trainer.double() - batch.sampled_logprobs.double()).abs()[mask.bool()]
    raw = raw_importance_weights(trainer, batch.sampled_logprobs, mask, "token")
    kl = correction_metrics(trainer, batch.sampled_logprobs, mask, raw, raw)["rollout/mismatch_kl"]
    return {
        "tokens": int(diff.numel()),
        "logprob_diff_mean": float(diff.mean()),
        "logprob_diff_p99": float(diff.quantile(0.99)),
        "logprob_diff_max": float(diff.max()),
        "mismatch_kl": float(kl),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)

    import torch
    from vllm_bench import chat_prompts, served

    from rlflow.engine.config.sampling import SamplingParams
    from rlflow.engine.models.loading import load_policy, load_tokenizer
    from rlflow.engine.rollout.replica import ReplicaClient

    torch.set_num_threads(1)
    tokenizer, policy = load_tokenizer(args.model), load_policy(args.model).eval()
    prompts = chat_prompts(tokenizer, args.prompts)
    params = SamplingParams(args.temperature, 1.0, args.new_tokens)
    report: dict = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens}
    report |= {"temperature": args.temperature, "trainer_dtype": "float32", "samplers": {}}
    for backend, dtype in SAMPLERS:
        with served(backend, args.model, dtype=dtype, vllm_python=args.vllm_python) as replica:
            with ReplicaClient(replica.url, replica.key, tokenizer, on_failure=replica.failure) as client:
                client.update_weights(policy.named_parameters(), 256, version=0)
                generation = client.generate(prompts, params, 0)
        figures = gap(tokenizer, policy, prompts, generation, params)
        report["samplers"][f"{backend}_{dtype}"] = figures
        print(f"{backend:>4} {dtype:>8}: " + "  ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)

    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"mismatch-{stamp}.json").write_text(json.dumps(report, indent=1))
    parts = []
    for name, figures in report["samplers"].items():
        parts.append(f"diff_max_{name}={figures['logprob_diff_max']:.3g}")
        parts.append(f"mismatch_kl_{name}={figures['mismatch_kl']:.3g}")
    print("RESULT " + " ".join(parts))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
