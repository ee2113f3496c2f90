"""The model sections (rlflow.engine.config.model): LoRA target modules, the GGUF file name, the path
the first stage loads and the adapters each stage trains."""

import re

import pytest
from pydantic import ValidationError

from rlflow.engine.config.model import LoraConfig, ModelConfig

TARGETS_MESSAGE = (
    'model.lora.target_modules must be a list naming at least one module (e.g. [q_proj, v_proj]) or "all-linear"'
)


@pytest.mark.parametrize("targets", [[], [""], ["q_proj", " "], "all", "q_proj", [3]])
def test_target_modules_must_name_a_module_or_be_all_linear(targets):
    with pytest.raises(ValidationError, match=re.escape(TARGETS_MESSAGE)):
        LoraConfig(target_modules=targets)


def test_lora_defaults_and_valid_targets():
    lora = LoraConfig()
    assert (lora.r, lora.alpha, lora.target_modules) == (8, 16.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert lora.stages == ["sft", "rm", "rl", "dpo"]
    assert LoraConfig(target_modules="all-linear").target_modules == "all-linear"
    with pytest.raises(ValidationError):
        LoraConfig(stages=["eval"])  # eval trains nothing


def test_the_gguf_file_is_a_name_inside_model_path():
    for bad in ("w.bin", "sub/w.gguf", "w.gguf.txt"):
        with pytest.raises(
            ValidationError, match=re.escape(f"model.gguf_file {bad!r} must be a file name ending in .gguf")
        ):
            ModelConfig(gguf_file=bad)
    assert ModelConfig(path="m").init_path == "m"
    assert ModelConfig(path="m", gguf_file="w.gguf").init_path == "m/w.gguf"
    assert ModelConfig(path="m/", gguf_file="w.gguf").init_path == "m/w.gguf"  # one separator


def test_each_stage_gets_the_adapters_only_if_it_is_listed():
    lora = LoraConfig(stages=["rm", "rl"])
    model = ModelConfig(lora=lora)
    assert [model.lora_for(s) is lora for s in ("sft", "rm", "rl", "dpo")] == [False, True, True, False]
    assert model.lora_for("sft") is None
    assert ModelConfig().lora_for("rl") is None  # no lora section: every weight trains
