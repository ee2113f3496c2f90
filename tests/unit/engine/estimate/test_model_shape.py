"""Model shapes (rlflow.engine.estimate.model_shape): parameter counts against real transformers
models and published figures, sizes like 7B, and model folders with bad configs.
"""

from dataclasses import replace

import pytest

from rlflow.engine.errors import ConfigError
from rlflow.engine.estimate.model_shape import (
    REFERENCE_SHAPES,
    load_model_shape,
    parse_size,
    resolve_model,
    shape_from_hf_config,
    shape_from_size,
)

LLAMA_8B = REFERENCE_SHAPES["Llama-3.1-8B"]


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_match_real_llama_models(tied):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention: K/V narrower than Q
        head_dim=16,
        vocab_size=101,
        tie_word_embeddings=tied,
        num_labels=1,
    )
    shape = shape_from_hf_config(config.to_dict(), "test")
    assert shape.lm_params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert shape.scalar_params == sum(p.numel() for p in LlamaForSequenceClassification(config).parameters())
    # FLOPs count every matmul weight: the LM head even when tied, never the embedding lookup.
    assert shape.lm_flop_params == shape.num_layers * shape.layer_params + 101 * 64


def test_parameter_count_of_qwen2_includes_its_qkv_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, tie_word_embeddings=True,
    )  # fmt: skip
    shape = shape_from_hf_config(config.to_dict(), "test")
    assert shape.bias_qkv and shape.lm_params == sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())


def test_reference_shapes_give_the_published_parameter_counts():
    assert REFERENCE_SHAPES["Llama-2-7B"].lm_params == 6_738_415_616
    assert LLAMA_8B.lm_params == 8_030_261_248
    assert REFERENCE_SHAPES["Llama-3.1-70B"].lm_params == 70_553_706_496
    assert REFERENCE_SHAPES["Qwen2.5-0.5B"].lm_params == 494_032_768


def test_sizes_parse_and_pick_the_nearest_reference_or_scale_its_depth():
    assert parse_size("7B") == 7e9 and parse_size("0.5b") == 5e8 and parse_size("350M") == 3.5e8
    assert parse_size("demo_assets/tiny-model") is None and parse_size("12") is None
    assert shape_from_size(7e9) == replace(REFERENCE_SHAPES["Llama-2-7B"], source=shape_from_size(7e9).source)
    twenty = shape_from_size(20e9)  # between 13B and 32B: Llama-2-13B widths, more layers
    assert abs(twenty.lm_params - 20e9) < twenty.layer_params and twenty.hidden_size == 5120


def test_model_folders_are_read_and_bad_ones_named(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,'
        ' "intermediate_size": 256, "vocab_size": 351, "tie_word_embeddings": true}'
    )
    assert load_model_shape(tmp_path / "m").num_kv_heads == 4  # defaults to the attention heads
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="neither a local model folder nor a size like 7B"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "m" / "config.json").write_text('{"hidden_size": 128}')
    with pytest.raises(ConfigError, match="no positive integer 'num_attention_heads'"):
        load_model_shape(tmp_path / "m")
