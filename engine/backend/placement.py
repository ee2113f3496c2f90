"""GPU placement per role, checked before any model loads.

`placement.train` / `placement.rollout` hold indices into the GPUs this process sees, i.e. after
CUDA_VISIBLE_DEVICES renumbering (index 0 is the first visible GPU, whatever its physical id).
None means "every visible GPU"; leaving both None colocates everything and is always valid, on
GPUs and on CPU-only machines alike.
"""

from __future__ import annotations

import os

from rlflow.engine.config.execution import PlacementConfig
from rlflow.engine.errors import ConfigError


def visible_gpu_count() -> int:
    """GPUs this process can use (torch.cuda.device_count(); 0 on a CPU-only build or machine).
    torch is imported here, not at module import, so the CLI's cheap checks stay cheap."""
    import torch

    return int(torch.cuda.device_count())


def _cvd(cuda_visible_devices: str | None) -> str:
    return (
        "CUDA_VISIBLE_DEVICES unset"
        if cuda_visible_devices is None
        else f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
    )


def _check_role(role: str, indices: list[int], num_visible_gpus: int, cvd: str) -> None:
    key = f"placement.{role}"
    if not indices:
        raise ConfigError(f"{key}=[] names no GPU: list GPU indices, or remove it (null) to use all visible GPUs")
    if num_visible_gpus == 0:
        raise ConfigError(
            f"{key}={indices} asks for GPU index {indices[0]} but no GPU is visible ({cvd}):"
            f" remove {key} to run on CPU, or run on a machine with GPUs"
        )
    seen: set[int] = set()
    for index in indices:
        if not 0 <= index < num_visible_gpus:
            raise ConfigError(
                f"{key}={indices}: GPU index {index} is out of range, {num_visible_gpus} GPU(s) are visible ({cvd});"
                f" use indices 0..{num_visible_gpus - 1} (they count visible GPUs, not physical ids)"
            )
        if index in seen:
            raise ConfigError(f"{key}={indices} lists GPU index {index} twice ({cvd}): list each GPU once")
        seen.add(index)


def validate_placement(
    placement: PlacementConfig, rollout_mode: str, num_visible_gpus: int, cuda_visible_devices: str | None
) -> None:
    """Raise ConfigError (one line naming the role, the GPU index and CUDA_VISIBLE_DEVICES) unless
    the placement can be honoured with `num_visible_gpus` visible GPUs:

    - every index in range, no duplicates, no empty list; with no visible GPU, no placement at all;
    - rollout.mode "server": train and rollout (separate processes) share no GPU;
    - rollout.mode "colocated": rollout runs inside the training ranks, so a rollout placement
      must name the same GPUs as the train placement (all visible GPUs when train is unset).
    A role left None is not checked against the other in server mode: where an unplaced server
    goes is the server launcher's decision.
    """
    cvd = _cvd(cuda_visible_devices)
    for role, indices in (("train", placement.train), ("rollout", placement.rollout)):
        if indices is not None:
            _check_role(role, indices, num_visible_gpus, cvd)
    train, rollout = placement.train, placement.rollout
    if rollout is None:
        return
    if rollout_mode == "server" and train is not None:
        shared = sorted(set(train) & set(rollout))
        if shared:
            raise ConfigError(
                f"placement.train={train} and placement.rollout={rollout} share GPU index {shared[0]} ({cvd}),"
                " but rollout.mode=server runs them as separate processes: give them disjoint indices"
            )
    elif rollout_mode == "colocated":
        effective_train = train if train is not None else list(range(num_visible_gpus))
        if set(rollout) != set(effective_train):
            index = min(set(rollout) ^ set(effective_train))
            raise ConfigError(
                f"placement.rollout={rollout} differs from placement.train={effective_train} at GPU index {index}"
                f" ({cvd}), but rollout.mode=colocated samples on the training GPUs: make them equal"
                " (or remove placement.rollout), or use rollout.mode=server"
            )


def devices_for(indices: list[int] | None, cuda_visible_devices: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a role's processes: its indices (relative to the GPUs this process
    sees) mapped to the ids the parent was given; None (no placement): inherit the parent's."""
    if indices is None:
        return None
    visible = [d.strip() for d in cuda_visible_devices.split(",")] if cuda_visible_devices else None
    return ",".join(visible[i] if visible else str(i) for i in indices)


def usable_cpu_count() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, cgroup cpusets), not the
    machine's total that os.cpu_count() reports."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def validate_process_count(
    nproc_per_node: int,
    train: list[int] | None,
    num_visible_gpus: int,
    num_cpus: int,
    cuda_visible_devices: str | None,
) -> None:
    """Raise ConfigError unless each of this node's `nproc_per_node` ranks gets a device of its own.

    On GPUs a rank uses the GPU of its local rank: a rank without one fails at startup (invalid
    device ordinal), and two on one GPU are refused by NCCL. On CPUs nothing fails, but ranks
    beyond the cores time-share them while every collective waits for the slowest: always
    slower than fewer ranks, so it is a config written for another machine.
    """
    cvd = _cvd(cuda_visible_devices)
    if num_visible_gpus > 0:
        gpus = len(train) if train is not None else num_visible_gpus
        if nproc_per_node > gpus:
            given = f"placement.train={train} gives training" if train is not None else "this machine has"
            raise ConfigError(
                f"resources.nproc_per_node={nproc_per_node} but {given} {gpus} GPU(s) ({cvd}): every rank needs"
                f" a GPU of its own - set resources.nproc_per_node to at most {gpus} or make more GPUs visible"
            )
    elif nproc_per_node > num_cpus:
        raise ConfigError(
            f"resources.nproc_per_node={nproc_per_node} but no GPU is visible ({cvd}) and this process may use"
            f" {num_cpus} CPU core(s): ranks beyond the cores only slow every step down - set"
            f" resources.nproc_per_node to at most {num_cpus}, or run on a machine with GPUs"
        )
