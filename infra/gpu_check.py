"""GPU check: a ~0.5B Qwen2-shaped model with random weights, a few PPO steps on the deepspeed
backend (ZeRO-3, bf16, sdpa), opened by the RL-run entry point as the stage opens them, and the
numbers that say whether the GPU path is healthy; then, where a vLLM environment is there
(`--vllm-python`), the vLLM replica path on the GPU: the trained actor's weights into a vLLM server
(bf16, CUDA graphs, chunked prefill) through rlflow's channel, a batch sampled, and the sync guard's
numbers against the trainer.

Run by infra/gpu_check.sh (which makes the carried wheels importable); nothing is downloaded.
Prints: rollout and training tokens/s, MFU of the training updates (model FLOPs / time over the
GPU's measured bf16 matmul rate), peak GPU memory, the weight-sync time to an `hf` rollout replica,
and for vLLM its start, sync seconds, tokens/s and log-prob gap. Budget: under 7 minutes on one
H100/H200-class GPU. Unverified on a GPU so far (no GPU was lent while it was written).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def matmul_tflops(seconds: float = 3.0, n: int = 8192) -> float:
    """Measured dense bf16 matmul rate (TFLOP/s): MFU's denominator, on this very GPU."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    torch.cuda.synchronize()
    return 2 * n**3 * count / (time.perf_counter() - started) / 1e12


def build_model(root: Path) -> tuple[str, int]:
    """Demo tokenizer and data, and a Qwen2-0.5B-shaped model with random weights in HF layout."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlflow.engine.tasksets.demo import make_demo_assets

    assets = make_demo_assets(root, seed=0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model_dir = assets / "qwen2-0.5b-random"
    model.save_pretrained(model_dir, safe_serialization=True)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(assets / "tiny-model").save_pretrained(model_dir)
    return str(model_dir), sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rollout-batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no GPU is visible (torch.cuda.is_available() is False)")
    from rlflow.engine.backend.factory import make_runtime
    from rlflow.engine.config.execution import EngineConfig, RolloutConfig
    from rlflow.engine.config.schema import build_config
    from rlflow.engine.rollout.service import RolloutService
    from rlflow.engine.stages.catalog import stage_inputs
    from rlflow.engine.stages.inputs import ModelInput, RewardModelInput
    from rlflow.engine.stages.rl.inputs import RLUpstream
    from rlflow.engine.stages.rl.run import RLRun

    t0 = time.monotonic()
    peak_tflops = matmul_tflops()
    work = Path(tempfile.mkdtemp(prefix="rlflow-gpu-check-"))
    model_dir, n_params = build_model(work)
    data = work / "data"
    cfg = build_config(
        {
            "model": {"path": model_dir, "dtype": "bfloat16", "attn_implementation": "sdpa"},
            "data": {"prompts": str(data / "prompts.jsonl"), "eval_prompts": str(data / "eval_prompts.jsonl"),
                     "max_prompt_tokens": 64, "chat_template": "none"},
            "rl": {"rollout_batch": args.rollout_batch, "mini_batch": args.rollout_batch // 2, "epochs": 1},
            "rollout": {"generate_batch": args.rollout_batch},
            "sampling": {"max_new_tokens": args.new_tokens, "temperature": 1.0},
        },
        "gpu_check",
    )  # fmt: skip
    runtime = make_runtime(EngineConfig(backend="deepspeed", zero_stage=3, precision="bf16"))
    model = ModelInput(uri=model_dir, identity="gpu-check")
    reward = RewardModelInput(uri=model_dir, identity="gpu-check", score_norm=(0.0, 1.0))
    upstream = RLUpstream(policy=model, reference=model, sft=model, reward_model=reward, critic=model)
    steps = []
    torch.cuda.reset_peak_memory_stats()
    with RLRun.open(runtime, stage_inputs(cfg, "rl", upstream)) as run:
        for step in range(1, args.steps + 1):
            steps.append(run.step(step))
        models = run.models
    peak_gb = torch.cuda.max_memory_allocated() / 2**30
    measured = steps[1:] or steps  # the first step pays warm-up costs
    tokens = statistics.median(m["perf/throughput"] * m["timing_s/step"] for m in measured)  # prompt+response tokens
    new_tokens = statistics.median(m["response_length/mean"] * args.rollout_batch for m in measured)
    gen_s = statistics.median(m["timing_s/gen"] for m in measured)
    update_s = statistics.median(m["timing_s/update_actor"] + m["timing_s/update_critic"] for m in measured)
    # Actor and critic updates: forward + backward = 6 FLOPs per parameter per token, each network.
    train_flops = 2 * 6 * n_params * tokens * cfg.rl.epochs
    service = RolloutService.start(RolloutConfig(mode="server", bucket_mb=512), model_dir, models.tokenizer, models.actor, None)
    sync = service.sync(models.actor)
    service.close()
    vllm = vllm_replica_check(args.vllm_python, model_dir, models, args.new_tokens)
    report = {
        "params_billion": n_params / 1e9,
        "gpu": torch.cuda.get_device_name(),
        "bf16_matmul_tflops": peak_tflops,
        "rollout_tokens_per_s": new_tokens / gen_s,
        "train_tokens_per_s": tokens * 2 * cfg.rl.epochs / update_s,
        "train_mfu": train_flops / update_s / (peak_tflops * 1e12),
        "peak_memory_gb": peak_gb,
        "step_seconds": statistics.median(m["timing_s/step"] for m in measured),
        "weight_sync_seconds": sync.get("timing_s/update_weights"),
        "weight_sync_gb_per_s": sync.get("rollout/sync_gb_per_s"),
        "vllm": vllm,
        "total_seconds": time.monotonic() - t0,
    }
    print(json.dumps(report, indent=2))
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.json").write_text(json.dumps(report, indent=2))
    runtime.close()


def vllm_replica_check(python: str, model_dir: str, models, new_tokens: int) -> dict:
    """The vLLM replica on this GPU, as the RL stage drives it: started, synced from the actor (shm,
    fingerprint on), 64 rows sampled; the trainer rescores them (the sync guard's log-prob gap)."""
    import subprocess

    imports = os.path.isfile(python) and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    if not imports:
        return {"skipped": f"{python} cannot import vllm (run `make vllm-env` on this machine)"}
    from rlflow.engine.config.sampling import SamplingParams
    from rlflow.engine.rollout.generate import batched_logprobs
    from rlflow.engine.rollout.replica import ReplicaClient
    from rlflow.engine.rollout.served import build_rollout_batch
    from rlflow.engine.rollout.vllm_replica import VLLMOptions, VLLMReplica
    from rlflow.engine.rollout.weight_sync import weights_fingerprint

    started = time.monotonic()
    gpu = torch.cuda.is_available()  # (a CPU smoke run of this function: eager, whole prompts)
    options = VLLMOptions(dtype="bfloat16", eager=not gpu, chunked_prefill=gpu, max_model_len=1024)
    replica = VLLMReplica.start(model_dir, python=python, options=options, startup_timeout_s=240)
    result: dict = {"start_seconds": time.monotonic() - started}
    try:
        with ReplicaClient(replica.url, replica.key, models.tokenizer, on_failure=replica.failure) as client:
            syncs = [client.update_weights(models.actor.named_full_parameters(), 512, version=v) for v in range(3)]
            trainer_fp = weights_fingerprint(models.actor.named_full_parameters(), round_to=client.dtype)
            prompts = [[5 + i % 50, 6, 7, 8] for i in range(64)]
            params = SamplingParams(1.0, 1.0, new_tokens)
            client.generate(prompts, params, 0)  # warm-up (CUDA graphs)
            sample_started = time.monotonic()
            generation = client.generate(prompts, params, 1)
            sample_s = time.monotonic() - sample_started
            batch = build_rollout_batch(models.tokenizer, prompts, generation, new_tokens)
            with torch.no_grad():
                trainer = batched_logprobs(models.actor.forward, batch, 1.0)
            diff = (trainer.float().cpu() - batch.sampled_logprobs).abs() * batch.response_mask
            result |= {
                "sync_seconds": statistics.median(s.seconds for s in syncs[1:]),
                "sync_gb_per_s": statistics.median(s.gb_per_s for s in syncs[1:]),
                "fingerprint_match": client.fingerprint() == trainer_fp,
                "tokens_per_s": sum(len(r) for r in generation.response_ids) / sample_s,
                "logprob_diff_mean": float(diff.sum() / batch.response_mask.sum()),
                "logprob_diff_max": float(diff.max()),
            }
    finally:
        replica.close()
    return result


if __name__ == "__main__":
    main()
