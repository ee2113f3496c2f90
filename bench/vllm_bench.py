"""Sampling and weight sync: in-process decode, an HF replica and a vLLM replica, side by side (`make bench`).

    python bench/vllm_bench.py [--model DIR] [--prompts 32] [--new-tokens 32] [--repeats 3] [--out DIR]

On one model (default: SmolLM2-135M-Instruct, models/smollm2-135m-instruct, `make bench` imports it),
each sampler gets one core (torch threads 1; the replica bound to the last core) and samples the same
chat prompts, `--repeats` times after a warm-up; then each takes `--repeats` weight updates of the whole
model (256 MB buckets, fingerprint included) through each channel. Samplers in turn, never two at once.
Each sync also splits the replica's side (its finish report): receive (the channel into its memory),
load (into the model: vLLM's weight loaders and the CPU's repacking) and fingerprint seconds. The host's
copy bound is one copy of the model's bytes (copy_s, timed here).
Prints tokens/s and seconds per sync (medians), writes bench/results/vllm-<UTC time>.json, and last
    RESULT vllm_vs_inprocess_tok_s=<ratio> hf_vs_inprocess_tok_s=<ratio> sync_s_vllm=<s> sync_s_vllm_gloo=<s>
           sync_s_vllm_fsspec=<s> sync_s_hf=<s> sync_s_hf_gloo=<s> sync_s_hf_fsspec=<s> copy_s=<s>
           shm_vllm_outside_load_s=<s>
(sync_s_<backend>: shared memory; sync_s_<backend>_gloo: the gloo group over loopback, the path a replica on
another host takes; sync_s_<backend>_fsspec: safetensors files on this machine's disk, the path of a replica
sharing only storage; shm_vllm_outside_load_s: a shared-memory sync less the vLLM replica's load and
fingerprint seconds, i.e. what the channel, its two copies and the HTTP calls took, against 2 x copy_s)
Tokens differ between samplers (other kernels, other RNG), so tokens/s counts the tokens each sampled.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        message = [{"role": "user", "content": f"What is {i % 9 + 1} + {(7 * i) % 13 + 2}? Explain."}]
        ids = tokenizer.apply_chat_template(message, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def timed_samples(sample, repeats: int) -> list[float]:
    """tokens/s of `repeats` calls after a warm-up; sample() returns the tokens it produced."""
    sample()
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = sample()
        rates.append(tokens / (time.perf_counter() - started))
    return rates


@contextlib.contextmanager
def served(backend: str, model: str, *, dtype: str = "float32", vllm_python: str = "") -> Iterator:
    """A replica of `model` on one core: rlflow's HF replica (one torch thread) or vLLM's server (bound
    to the last core); stopped on exit."""
    from rlflow.engine.rollout.replicas import replica_cores, start_hf_replica
    from rlflow.engine.rollout.vllm_replica import VLLMOptions, VLLMReplica

    if backend == "hf":
        replica = start_hf_replica(model, dtype=dtype, threads=1)
    else:
        replica = VLLMReplica.start(model, python=vllm_python, options=VLLMOptions(dtype=dtype, cores=replica_cores(1)))
    try:
        yield replica
    finally:
        replica.close()


def timed_syncs(client, policy, repeats: int) -> dict[str, list[float]]:
    """{"sync_s": seconds per whole update, "replica_<phase>_s": the replica's seconds in each phase}."""
    timed: dict[str, list[float]] = {}
    for version in range(1, repeats + 1):
        started = time.perf_counter()
        stats = client.update_weights(policy.named_parameters(), 256, version=version)
        client.fingerprint()
        timed.setdefault("sync_s", []).append(time.perf_counter() - started)
        for phase, seconds in stats.replica_s.items():
            timed.setdefault(f"replica_{phase}_s", []).append(seconds)
    return timed


def copy_seconds(policy, repeats: int) -> list[float]:
    """One copy of every parameter's bytes into memory already allocated: the host's copy bound."""
    import torch

    sources = [p.detach() for p in policy.parameters()]
    targets = [torch.empty_like(s) for s in sources]
    seconds = []
    for _ in range(repeats + 1):  # the first touches the targets' pages
        started = time.perf_counter()
        for target, source in zip(targets, sources):
            target.copy_(source)
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def prefixed(prefix: str, timed: dict[str, list[float]]) -> dict[str, list[float]]:
    return {prefix + key: values for key, values in timed.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)

    import torch

    from rlflow.engine.config.sampling import SamplingParams
    from rlflow.engine.models.loading import load_policy, load_tokenizer
    from rlflow.engine.rollout.generate import generate_rollouts
    from rlflow.engine.rollout.replica import ReplicaClient

    torch.set_num_threads(1)
    tokenizer, policy = load_tokenizer(args.model), load_policy(args.model).eval()
    prompts, params = chat_prompts(tokenizer, args.prompts), SamplingParams(1.0, 1.0, args.new_tokens)
    counted = lambda generation: sum(len(r) for r in generation.response_ids)  # noqa: E731
    report: dict = {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens, "threads": 1}

    def inprocess() -> int:
        with torch.no_grad():
            return int(generate_rollouts(policy, tokenizer, prompts, params, seed=0).response_mask.sum())

    report["inprocess_tok_s"] = timed_samples(inprocess, args.repeats)
    report["copy_s"] = copy_seconds(policy, args.repeats)
    for backend in ("hf", "vllm"):
        with served(backend, args.model, vllm_python=args.vllm_python) as replica:
            with ReplicaClient(replica.url, replica.key, tokenizer, on_failure=replica.failure) as shm:
                shm.update_weights(policy.named_parameters(), 256, version=0)
                report[f"{backend}_tok_s"] = timed_samples(lambda: counted(shm.generate(prompts, params, 0)),
                                                           args.repeats)  # fmt: skip
                report |= prefixed(f"{backend}_", timed_syncs(shm, policy, args.repeats))
            with ReplicaClient(replica.url, replica.key, tokenizer, transport="gloo") as gloo:
                report |= prefixed(f"{backend}_gloo_", timed_syncs(gloo, policy, args.repeats))  # the cross-host path
            with tempfile.TemporaryDirectory(prefix="rlflow-weights-") as folder:  # this disk, as a shared one
                url = f"file://{folder}"
                with ReplicaClient(replica.url, replica.key, tokenizer, transport="fsspec", weights_url=url) as files:
                    report |= prefixed(f"{backend}_fsspec_", timed_syncs(files, policy, args.repeats))

    medians = {key: statistics.median(values) for key, values in report.items() if isinstance(values, list)}
    for key, value in medians.items():
        print(f"{key:>18}: {value:.3g}  (runs: {', '.join(f'{v:.3g}' for v in report[key])})")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"vllm-{stamp}.json").write_text(json.dumps(report | {"medians": medians}, indent=1))
    base = medians["inprocess_tok_s"]
    outside = [s - load - fp for s, load, fp in zip(report["vllm_sync_s"], report["vllm_replica_load_s"],
                                                     report["vllm_replica_fingerprint_s"])]  # fmt: skip
    print(
        f"RESULT vllm_vs_inprocess_tok_s={medians['vllm_tok_s'] / base:.3g}"
        f" hf_vs_inprocess_tok_s={medians['hf_tok_s'] / base:.3g}"
        f" sync_s_vllm={medians['vllm_sync_s']:.3g} sync_s_vllm_gloo={medians['vllm_gloo_sync_s']:.3g}"
        f" sync_s_vllm_fsspec={medians['vllm_fsspec_sync_s']:.3g}"
        f" sync_s_hf={medians['hf_sync_s']:.3g} sync_s_hf_gloo={medians['hf_gloo_sync_s']:.3g}"
        f" sync_s_hf_fsspec={medians['hf_fsspec_sync_s']:.3g} copy_s={medians['copy_s']:.3g}"
        f" shm_vllm_outside_load_s={statistics.median(outside):.3g}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
