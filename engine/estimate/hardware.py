"""Devices and prices for the cost estimate: configs/prices.yaml, and a short CPU calibration.

A GPU's numbers come from its datasheet (in prices.yaml); a CPU has no datasheet worth trusting
(cores, turbo, AVX width and neighbours all vary), so its peak matmul rate and memory bandwidth
are measured when the estimate runs, in about a second.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from rlflow.engine.errors import ConfigError

CPU_DEVICE = "cpu"


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type (or the CPU): capacities and rates; all rates are peaks per device."""

    name: str
    memory_gib: float  # usable device memory, GiB (host RAM for the CPU)
    bf16_tflops: float  # dense peak, 1e12 FLOP/s
    fp32_tflops: float  # dense peak, plain FP32 (the engine does not enable TF32)
    memory_gbs: float  # device memory bandwidth, 1e9 bytes/s
    interconnect_gbs: float  # collective bus bandwidth between devices of one node, 1e9 bytes/s
    pcie_gbs: float  # host <-> device copies, 1e9 bytes/s
    network_gbs: float  # between nodes, per device, 1e9 bytes/s
    gpus_per_node: int
    host_memory_gib: float  # RAM of one node, GiB (offloaded states live there)
    price_per_gpu_hour: float  # in PriceBook.currency
    measured: bool = False  # rates come from a calibration run, not a datasheet

    @property
    def is_cpu(self) -> bool:
        return self.name == CPU_DEVICE

    def peak_flops(self, compute: str) -> float:
        """Peak FLOP/s for a compute dtype, "bf16" or "fp32"."""
        return (self.bf16_tflops if compute == "bf16" else self.fp32_tflops) * 1e12

    def collective_gbs(self, n_devices: int) -> float:
        """Bus bandwidth of a collective over n devices: NVLink/PCIe within a node, the network beyond."""
        return self.interconnect_gbs if n_devices <= self.gpus_per_node else self.network_gbs


@dataclass(frozen=True)
class PriceBook:
    currency: str
    devices: dict[str, dict[str, Any]]  # name -> the prices.yaml entry (None = measured on "cpu")
    source: str


@dataclass(frozen=True)
class CpuCalibration:
    """What this machine measured: fp32 matmul rate, copy bandwidth, RAM."""

    fp32_tflops: float
    memory_gbs: float
    ram_gib: float


SPEC_KEYS = tuple(f.name for f in fields(DeviceSpec) if f.name not in ("name", "measured"))
MEASURED_KEYS = (
    "memory_gib",
    "bf16_tflops",
    "fp32_tflops",
    "memory_gbs",
    "interconnect_gbs",
    "pcie_gbs",
    "host_memory_gib",
)


def load_price_book(path: str | Path) -> PriceBook:
    """Read prices.yaml; ConfigError naming the file and key when something is missing or wrong."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prices file not found: {path} (give one with --prices; see configs/prices.yaml)")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(tree, dict) or not isinstance(tree.get("devices"), dict) or not tree["devices"]:
        raise ConfigError(f"{path}: needs a 'devices:' mapping of device name -> specs and price")
    currency = tree.get("currency")
    if not isinstance(currency, str) or not currency:
        raise ConfigError(f"{path}: needs 'currency:' (e.g. USD), the unit of every price_per_gpu_hour")
    for name, entry in tree["devices"].items():
        _check_entry(path, str(name), entry)
    return PriceBook(currency=currency, devices={str(k): dict(v) for k, v in tree["devices"].items()}, source=str(path))


def _check_entry(path: Path, name: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: devices.{name} must be a mapping of {', '.join(SPEC_KEYS)}")
    unknown = sorted(set(entry) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key devices.{name}.{unknown[0]}; valid keys: {', '.join(SPEC_KEYS)}")
    for key in SPEC_KEYS:
        value = entry.get(key)
        if value is None and name == CPU_DEVICE and key in MEASURED_KEYS:
            continue  # measured at estimate time
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{path}: devices.{name}.{key} must be a positive number, got {value!r}")


def device_spec(book: PriceBook, name: str, calibration: CpuCalibration | None = None) -> DeviceSpec:
    """The named device; "cpu" fills its measured (null) fields from `calibration`."""
    if name not in book.devices:
        raise ConfigError(f"unknown GPU type {name!r} (--gpu); valid types in {book.source}: {', '.join(book.devices)}")
    entry = dict(book.devices[name])
    missing = [key for key in SPEC_KEYS if entry.get(key) is None]
    if missing and calibration is None:
        raise ConfigError(f"devices.{name} in {book.source} leaves {', '.join(missing)} to a CPU calibration")
    if missing:
        measured = {
            "memory_gib": calibration.ram_gib,
            "bf16_tflops": calibration.fp32_tflops,  # bf16 matmuls on a CPU are no faster; often slower
            "fp32_tflops": calibration.fp32_tflops,
            "memory_gbs": calibration.memory_gbs,
            "interconnect_gbs": calibration.memory_gbs,  # processes of one machine share its memory
            "pcie_gbs": calibration.memory_gbs,  # "offloading" to the host is a copy within RAM
            "host_memory_gib": calibration.ram_gib,
        }
        entry.update({key: measured[key] for key in missing})
    return DeviceSpec(name=name, measured=bool(missing), **{k: entry[k] for k in SPEC_KEYS})


def measure_cpu(matmul_size: int = 2048, copy_mib: int = 256, repeats: int = 5) -> CpuCalibration:
    """Median fp32 torch.mm rate (FLOP = 2 n^3) and copy bandwidth (bytes read + written) of this
    machine with torch's current thread count; RAM from sysconf. Takes about a second."""
    import torch

    a, b = torch.randn(matmul_size, matmul_size), torch.randn(matmul_size, matmul_size)
    matmul_s = _median_seconds(lambda: torch.mm(a, b), repeats)
    source = torch.randn(copy_mib * 2**20 // 4)
    target = torch.empty_like(source)
    copy_s = _median_seconds(lambda: target.copy_(source), repeats)
    return CpuCalibration(
        fp32_tflops=2 * matmul_size**3 / matmul_s / 1e12,
        memory_gbs=2 * source.numel() * 4 / copy_s / 1e9,
        ram_gib=host_ram_gib(),
    )


def _median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm-up: thread pool start, first-touch page faults
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def host_ram_gib() -> float:
    """Physical memory of this machine, GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
