"""fp32 matmul rates of torch's two CPU backends at the shapes of a SmolLM2 training step.

    .venv/bin/python bench/matmul_backends.py            # ~1 min on 2 cores

Why: `make bench`'s ratios against TRL move with the CPU (docs/benchmarks.md). torch's `mm` runs
MKL, which dispatches per CPU vendor; rlflow's decode loop runs oneDNN's packed matmul
(`torch.ops.mkldnn._linear_pointwise`) for its wide matrices. This prints, per shape of the step's
linear layers (8 rows x 39 tokens = 312), the GFLOP/s of `torch.mm` (the forward x @ W^T and the
two backward products) and of oneDNN with W packed once, as medians of interleaved repetitions.
"""

from __future__ import annotations

import statistics
import time

import torch

ROWS = 312  # 8 sequences x 39 tokens, the bench's GRPO batch
SHAPES = {  # (in, out) of SmolLM2-135M's linear layers
    "q/o 576->576": (576, 576),
    "k/v 576->192": (576, 192),
    "gate/up 576->1536": (576, 1536),
    "down 1536->576": (1536, 576),
    "head 576->49152": (576, 49152),
}


def _seconds(fn, calls: int = 5) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def main() -> None:
    torch.set_num_threads(2)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    print(f"{cpu}, torch {torch.__version__}, 2 threads, fp32, {ROWS} rows; GFLOP/s, median of 7 interleaved reps")
    print(f"{'shape':<20}{'mm x@W^T':>10}{'oneDNN':>10}{'mm g^T@x':>10}{'mm g@W':>10}")
    for name, (k, n) in SHAPES.items():
        x, w, g = torch.randn(ROWS, k), torch.randn(n, k), torch.randn(ROWS, n)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS)
        cases = [
            lambda: torch.mm(x, w.t()),
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            lambda: torch.mm(g.t(), x),
            lambda: torch.mm(g, w),
        ]
        for case in cases:
            case()  # warm
        times: list[list[float]] = [[] for _ in cases]
        for _ in range(7):
            for i, case in enumerate(cases):
                times[i].append(_seconds(case))
        flops = 2 * ROWS * k * n
        rates = [flops / statistics.median(t) / 1e9 for t in times]
        print(f"{name:<20}" + "".join(f"{r:>10.0f}" for r in rates))


if __name__ == "__main__":
    main()
