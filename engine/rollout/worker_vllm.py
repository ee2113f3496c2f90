"""The vLLM rollout worker: the protocol of `rollout_worker`, sampling with vLLM on a GPU.

Runs only under the separate vLLM interpreter (`make vllm-env` builds .venv-vllm with
requirements-vllm.txt: vllm==0.32.0, torch==2.13.0; config key rollout.vllm_python). vLLM is
imported inside the backend, never at module import, so the project's own environment (which
cannot hold vLLM, see MACHINE-NOTES) can import this module. Untested on a GPU: written against
the public API of vLLM 0.32, listed here so a version bump knows what to re-check:

- `vllm.LLM(model=, dtype=, seed=, generation_config="vllm", logprobs_mode="processed_logprobs",
  skip_tokenizer_init=True, worker_extension_cls=...)`; extra engine arguments (e.g.
  gpu_memory_utilization, tensor_parallel_size) come as a JSON object in RLFLOW_VLLM_ENGINE_ARGS.
  generation_config="vllm" ignores the checkpoint's sampling defaults, as `generate_rollouts`
  (engine/rollout/decode.py) never reads them.
- `LLM.generate([TokensPrompt(prompt_token_ids=...)], [SamplingParams(...)], use_tqdm=False)` with
  `SamplingParams(temperature, top_p, max_tokens, seed, logprobs=0, stop_token_ids=stops,
  detokenize=False)`: logprobs=0 returns the sampled token's log-prob; processed_logprobs makes it
  the log-prob after temperature scaling (the distribution PPO's ratio uses). If a vLLM version
  also folds top-p truncation into processed log-probs, runs with top_p < 1 fail the log-prob
  probe: that is the guard working, not a bug to silence.
- `LLM.collective_rpc("rlflow_load_bucket", args=...)` runs `WeightLoader.rlflow_load_bucket` in
  every GPU worker (the RLHF weight-update hook of vLLM's examples/offline_inference/rlhf*.py);
  there `self.model_runner.model.load_weights(weights=[(hf_name, tensor), ...])` maps HF names onto
  vLLM's fused layers (qkv_proj, gate_up_proj). Only a path, offsets and names cross the RPC; the
  bytes are read from the trainer's staging memfd through /proc/<pid>/fd/<fd>.
- `LLM.reset_prefix_cache()` after each update: cached KV blocks were computed with old weights.

Seeds: row i of a request samples with seed `row_seed(seed, i)`, so equal prompts in one batch
still get independent draws. Tokens never equal the hf backend's (different kernels and RNG).

Fingerprint: vLLM's fused parameters have no HF names, so this worker fingerprints what it was
given: per-tensor digests of the checkpoint at start, replaced by each received tensor (rounded to
the worker dtype). It proves every tensor the trainer holds arrived; the log-prob probe proves
load_weights really changed what the sampler uses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from rlflow.engine.rollout.worker import BucketSource, GenerateRequest, GenerateResult, RequestError
from rlflow.engine.rollout.worker_session import run_worker
from rlflow.engine.rollout.weight_sync import (
    DTYPES,
    TensorEntry,
    fingerprint_from_digests,
    tensor_digest,
    unpack_bucket,
)


def row_seed(seed: int, row: int) -> int:
    return (seed * 1_000_003 + row) % (1 << 63)


class WeightLoader:
    """Mixed into vLLM's GPU worker class (worker_extension_cls): `self` is that worker."""

    def rlflow_load_bucket(self, path: str, offset: int, nbytes: int, entries: list[dict[str, Any]]) -> int:
        import mmap

        with open(path, "r+b") as f:  # /proc/<pid>/fd/<fd>: re-opens the rollout worker's staging memfd
            mapped = mmap.mmap(f.fileno(), offset + nbytes)
        buffer = torch.frombuffer(mapped, dtype=torch.uint8)[offset : offset + nbytes]
        parsed = [TensorEntry.from_json(e) for e in entries]
        weights = [(name, view.to(self.device)) for name, view in unpack_bucket(parsed, buffer)]
        self.model_runner.model.load_weights(weights=weights)
        torch.cuda.synchronize()
        return len(weights)


class VLLMBackend:
    name = "vllm"

    def __init__(self, model_dir: str, dtype: str, trust_remote_code: bool = False):
        from vllm import LLM

        extra = json.loads(os.environ.get("RLFLOW_VLLM_ENGINE_ARGS", "{}"))
        self.dtype = DTYPES[dtype]
        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            seed=0,
            trust_remote_code=trust_remote_code,
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            worker_extension_cls=f"{__name__}.WeightLoader",
            **extra,
        )
        self.digests = self._checkpoint_digests(model_dir)

    def _checkpoint_digests(self, model_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
        from safetensors import safe_open

        digests = {}
        for file in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
            with safe_open(os.path.join(model_dir, file), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    tensor = weights.get_tensor(name)
                    digests[name] = (tuple(tensor.shape), tensor_digest(tensor, self.dtype))
        return digests

    def describe(self) -> dict[str, Any]:
        return {"tensors": len(self.digests)}

    def generate(self, request: GenerateRequest) -> GenerateResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=request.max_new_tokens,
                seed=row_seed(request.seed, i),
                logprobs=0,
                stop_token_ids=list(request.stop_token_ids),
                detokenize=False,
            )
            for i in range(len(request.prompts))
        ]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in request.prompts]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        ids: list[int] = []
        logprobs: list[float] = []
        lengths = []
        for output in outputs:
            sample = output.outputs[0]
            tokens = list(sample.token_ids)
            ids += tokens
            logprobs += [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
            lengths.append(len(tokens))
        return GenerateResult(
            lengths, torch.tensor(ids, dtype=torch.int64), torch.tensor(logprobs, dtype=torch.float32)
        )

    def begin_update(self) -> None:
        pass

    def load(self, entries: list[TensorEntry], source: BucketSource) -> None:
        if source.path is None:
            raise RequestError("the vllm worker reads weights from shared memory; call update_weights(transport='shm')")
        for name, view in unpack_bucket(entries, source.buffer):
            self.digests[name] = (tuple(view.shape), tensor_digest(view, self.dtype))
        nbytes = source.buffer.numel()
        self.llm.collective_rpc(
            "rlflow_load_bucket", args=(source.path, source.offset, nbytes, [e.to_json() for e in entries])
        )

    def end_update(self) -> None:
        self.llm.reset_prefix_cache()

    def fingerprint(self) -> str:
        return fingerprint_from_digests(self.digests)


def make_backend(args: argparse.Namespace) -> VLLMBackend:
    return VLLMBackend(args.model_dir, args.dtype, args.trust_remote_code)


def main(argv: list[str] | None = None) -> int:
    return run_worker(make_backend, argv)


if __name__ == "__main__":
    sys.exit(main())
