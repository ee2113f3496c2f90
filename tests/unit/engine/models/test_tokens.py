"""Stop ids and the pad token (engine/models/tokens.py): what a chat model's files say ends a turn."""

import json

import torch

from rlflow.engine.models.tokens import choose_pad_id, generation_config_stop_ids, merge_ids, response_mask_from_ids


def test_the_mask_ends_at_the_first_of_several_stop_ids():
    ids = torch.tensor([[5, 7, 9, 9], [5, 6, 7, 8], [9, 3, 7, 0], [4, 4, 4, 4]])
    assert response_mask_from_ids(ids, (7, 9)).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert response_mask_from_ids(ids, 9).tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_generation_config_stop_ids_as_int_or_list(tmp_path):
    assert generation_config_stop_ids(str(tmp_path)) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert generation_config_stop_ids(str(tmp_path)) == (151645, 151643)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 2}))
    assert generation_config_stop_ids(str(tmp_path)) == (2,)


def test_stop_ids_keep_order_and_drop_duplicates():
    assert merge_ids([2, None], (0, 2), [5]) == (2, 0, 5)


def test_pad_is_a_special_token_outside_the_stop_set():
    # candidates come in order of preference (configure_token_roles: unknown token first, BOS last)
    assert choose_pad_id(2, [0, 2, 1], (2,)) == 0
    assert choose_pad_id(2, [2, 1], (2,)) == 1
    assert choose_pad_id(0, [1, 2, 0], (2,)) == 0  # a pad already outside the stop set stays
    assert choose_pad_id(None, [2], (2,)) == 2  # nothing else: EOS pads, as masks come from lengths
    assert choose_pad_id(None, [2, 0], (2, 0)) == 2


def test_smollm2_style_tokenizer_pads_with_its_unknown_token_not_bos(tmp_path):
    """pad = eos = <|im_end|> in the shipped files; <|endoftext|> (the unknown token) pads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlflow.engine.models.tokens import configure_token_roles, stop_token_ids

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    configure_token_roles(tokenizer, str(tmp_path))
    assert stop_token_ids(tokenizer) == (2, 0)
    assert tokenizer.pad_token_id == 1  # 0 ends a response here, so BOS is the only spare left
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tokenizer.pad_token = "<|im_end|>"
    configure_token_roles(tokenizer, str(tmp_path))
    assert stop_token_ids(tokenizer) == (2,) and tokenizer.pad_token_id == 0 and len(tokenizer) == 5
