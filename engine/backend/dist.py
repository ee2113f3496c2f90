"""Collectives every stage needs, as plain functions that are identities in a single process.

Only tensors and JSON cross ranks: nothing is pickled, even between our own processes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as torch_dist


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    return torch_dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return torch_dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def _device() -> torch.device:
    """Where collective buffers live: NCCL only moves GPU tensors, gloo CPU ones."""
    if is_distributed() and torch_dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        torch_dist.barrier()


def all_reduce_sum(value: torch.Tensor | float) -> torch.Tensor:
    """Sum over ranks of a tensor (or float), returned as a new float64 tensor on the CPU."""
    tensor = torch.as_tensor(value, dtype=torch.float64).detach().clone().to(_device())
    if is_distributed():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor.cpu()


def all_reduce_max(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    if is_distributed():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return int(tensor.item())


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable `obj`, in rank order."""
    if not is_distributed():
        return [obj]
    device = _device()
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size())]
    torch_dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in sizes]
    torch_dist.all_gather(chunks, padded.to(device))
    return [json.loads(bytes(c[: int(s.item())].cpu().tolist()).decode()) for c, s in zip(chunks, sizes)]


def all_gather_rows(tensor: torch.Tensor, pad_value: float, pad_left: bool = False) -> torch.Tensor:
    """Concatenate every rank's [b, T_r, ...] tensor along rows (rank order), padding the second
    dimension to the widest rank (on the left for left-padded prompts). Rows per rank may differ.
    Returns a CPU tensor."""
    tensor = tensor.cpu()
    if not is_distributed():
        return tensor
    shapes = all_gather_json(list(tensor.shape))
    width = max(s[1] for s in shapes) if tensor.dim() > 1 else 0
    rows = max(s[0] for s in shapes)
    padded = torch.full(
        (rows, *([width] if tensor.dim() > 1 else []), *tensor.shape[2:]), pad_value, dtype=tensor.dtype
    )
    if tensor.dim() > 1 and pad_left:
        padded[: tensor.shape[0], width - tensor.shape[1] :] = tensor
    elif tensor.dim() > 1:
        padded[: tensor.shape[0], : tensor.shape[1]] = tensor
    else:
        padded[: tensor.shape[0]] = tensor
    device = _device()
    chunks = [torch.empty_like(padded, device=device) for _ in shapes]
    torch_dist.all_gather(chunks, padded.contiguous().to(device))
    return torch.cat([c[: s[0]].cpu() for c, s in zip(chunks, shapes)])


def rank_chunks(n_items: int, chunk: int) -> list[tuple[int, bool]]:
    """The chunks (index, real) this rank processes: chunks rank, rank + world, ...; ranks with
    fewer real chunks repeat their last (real=False) so every rank makes the same number of
    passes, which ZeRO-3 needs (each forward gathers weights from all ranks)."""
    n_chunks = -(-n_items // chunk)
    mine = list(range(rank(), n_chunks, world_size()))
    passes = -(-n_chunks // world_size())
    fill = mine[-1] if mine else 0
    return [(c, True) for c in mine] + [(fill, False)] * (passes - len(mine))


def _chunk_order(n_items: int, chunk: int) -> list[int]:
    """Global row positions in the order ranks' real chunks are concatenated by a gather."""
    n_chunks = -(-n_items // chunk)
    order: list[int] = []
    for r in range(world_size()):
        for c in range(r, n_chunks, world_size()):
            order.extend(range(c * chunk, min(n_items, (c + 1) * chunk)))
    return order


def gather_chunked(local: torch.Tensor, n_items: int, chunk: int, pad_value: float, pad_left: bool = False):
    """Rows of every rank's real chunks (concatenated in this rank's chunk order) -> all rows in
    global order, on every rank. Widths are padded to the widest rank's."""
    gathered = all_gather_rows(local, pad_value, pad_left)
    if not is_distributed():
        return gathered
    out = torch.empty_like(gathered)
    out[torch.tensor(_chunk_order(n_items, chunk))] = gathered
    return out


def gather_chunked_list(local: list[Any], n_items: int, chunk: int) -> list[Any]:
    """gather_chunked for JSON values (texts)."""
    if not is_distributed():
        return list(local)
    flat = [x for part in all_gather_json(list(local)) for x in part]
    out: list[Any] = [None] * n_items
    for position, value in zip(_chunk_order(n_items, chunk), flat):
        out[position] = value
    return out
