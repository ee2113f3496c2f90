"""Devices and the price book (rlflow.engine.estimate.hardware): the measured CPU device, unknown
devices and bad price entries named.
"""

from pathlib import Path

import pytest

from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.hardware import CpuCalibration, device_spec, load_price_book, measure_cpu

ROOT = Path(__file__).parents[4]
PRICES = load_price_book(ROOT / "configs" / "prices.yaml")
FIXED_CPU = CpuCalibration(fp32_tflops=0.138, memory_gbs=11.2, ram_gib=23.6)


def test_the_cpu_device_is_measured_and_unknown_devices_list_the_valid_ones():
    cpu = device_spec(PRICES, "cpu", FIXED_CPU)
    assert cpu.measured and cpu.fp32_tflops == 0.138 and cpu.memory_gib == 23.6
    with pytest.raises(ConfigError, match=r"unknown GPU type 'a100' \(--gpu\); valid types in .*a100-80g"):
        device_spec(PRICES, "a100")
    with pytest.raises(ConfigError, match="CPU calibration"):
        device_spec(PRICES, "cpu")
    quick = measure_cpu(matmul_size=128, copy_mib=4, repeats=1)
    assert quick.fp32_tflops > 0 and quick.memory_gbs > 0 and quick.ram_gib > 0


def test_a_bad_price_entry_is_named(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text("currency: EUR\ndevices:\n  x:\n    memory_gib: -1\n")
    with pytest.raises(ConfigError, match=r"devices.x.memory_gib must be a positive number, got -1"):
        load_price_book(path)
    path.write_text("devices: {}\n")
    with pytest.raises(ConfigError, match="devices"):
        load_price_book(path)


def test_a_device_entry_is_read_as_written_and_its_rates_pick_dtype_and_link(tmp_path):
    path = tmp_path / "prices.yaml"
    path.write_text(
        "currency: EUR\ndevices:\n  g:\n    memory_gib: 40\n    bf16_tflops: 300\n    fp32_tflops: 20\n"
        "    memory_gbs: 1500\n    interconnect_gbs: 200\n    pcie_gbs: 25\n    network_gbs: 12.5\n"
        "    gpus_per_node: 4\n    host_memory_gib: 512\n    price_per_gpu_hour: 2.5\n"
    )
    book = load_price_book(path)
    assert (book.currency, list(book.devices), book.source) == ("EUR", ["g"], str(path))
    g = device_spec(book, "g")
    assert not g.measured and not g.is_cpu and g.price_per_gpu_hour == 2.5
    assert (g.peak_flops("bf16"), g.peak_flops("fp32")) == (300e12, 20e12)
    # up to a node's 4 GPUs the collective runs over the interconnect, beyond it over the network
    assert [g.collective_gbs(n) for n in (1, 4, 5, 8)] == [200, 200, 12.5, 12.5]
    path.write_text("currency: EUR\ndevices:\n  g: {memory_gib: 40, colour: red}\n")
    with pytest.raises(ConfigError, match=r"unknown key devices\.g\.colour; valid keys: memory_gib, bf16_tflops"):
        load_price_book(path)
    with pytest.raises(ConfigError, match="prices file not found"):
        load_price_book(tmp_path / "none.yaml")
