"""Observation ids are the template's delimiters around only the new messages, and a trajectory's ids
are never re-tokenised: checked on the tiny demo tokenizer given the ChatML tool template, and on
SmolLM2-135M-Instruct's own tokenizer and template (which ignores `tools=`)."""

import pytest
from transformers import AutoTokenizer

from rlflow.engine.data.batching import encode_pair
from rlflow.engine.envs.chat import ChatTemplateError, ConversationEncoder, with_tool_instructions
from rlflow.engine.envs.tools import CALCULATOR
from rlflow.engine.tasksets.demo import make_chat_tokenizer, make_tokenizer

TOOLS = [CALCULATOR.schema()]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>'


@pytest.fixture(scope="module")
def tiny_chat_tokenizer():
    return make_chat_tokenizer(["what is 1234 times 5678", CALL, "the answer is 7006652", "calculator expression"])


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def sampled_turn(tokenizer, text: str) -> list[int]:
    """What a model that wrote `text` and ended its turn sampled (canonical ids)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("which", ["tiny_chat_tokenizer", "smollm2_tokenizer"])
def test_the_ids_spell_what_the_template_renders_for_the_whole_conversation(which, request):
    tokenizer = request.getfixturevalue(which)
    encoder = ConversationEncoder(tokenizer, TOOLS)
    first = [{"role": "user", "content": "what is 1234 times 5678"}]
    ids = encoder.prompt_ids(first)
    turn = sampled_turn(tokenizer, CALL)
    observation = [{"role": "tool", "content": "7006652"}]
    ids = ids + turn + encoder.observation_ids(observation, turn[-1])
    shown = first if encoder.template_tools else with_tool_instructions(first, TOOLS)
    conversation = shown + [{"role": "assistant", "content": CALL}] + observation
    expected = tokenizer.apply_chat_template(
        conversation, tools=TOOLS if encoder.template_tools else None, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(ids) == expected


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(smollm2_tokenizer, tiny_chat_tokenizer):
    assert ConversationEncoder(tiny_chat_tokenizer, TOOLS).template_tools
    encoder = ConversationEncoder(smollm2_tokenizer, TOOLS)
    assert not encoder.template_tools
    text = smollm2_tokenizer.decode(encoder.prompt_ids([{"role": "user", "content": "hi"}]))
    assert text.startswith("<|im_start|>system\nYou can call these tools.") and '"name": "calculator"' in text
    assert "SmolLM" not in text  # the template's default system prompt gives way to the tools'
    own = encoder.prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert "</tools><|im_end|>" not in smollm2_tokenizer.decode(own) and "</tools>\n\nBe brief." in (
        smollm2_tokenizer.decode(own))


def non_canonical_spelling(tokenizer) -> tuple[list[int], list[int]]:
    """A text's ids as the tokenizer writes them and as a model may sample them (split in two)."""
    for word in (" answer", " calculator", " number", " result", "answer", "tool"):
        ids = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(ids) == 1:
            cut = len(word) // 2
            split = [tokenizer(part, add_special_tokens=False)["input_ids"] for part in (word[:cut], word[cut:])]
            return ids, split[0] + split[1]
    raise AssertionError("no single-token word found")


@pytest.mark.parametrize("which", ["tiny_chat_tokenizer", "smollm2_tokenizer"])
def test_sampled_ids_survive_where_re_tokenising_would_change_them(which, request):
    tokenizer = request.getfixturevalue(which)
    encoder = ConversationEncoder(tokenizer, TOOLS)
    canonical, sampled = non_canonical_spelling(tokenizer)
    assert tokenizer.decode(sampled) == tokenizer.decode(canonical) and sampled != canonical
    prompt = encoder.prompt_ids([{"role": "user", "content": "hi"}])
    turn = sampled + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    observation = encoder.observation_ids([{"role": "tool", "content": "7"}], turn[-1])
    trajectory = prompt + turn + observation
    assert trajectory[len(prompt):len(prompt) + len(turn)] == turn
    re_encoded = tokenizer(tokenizer.decode(trajectory), add_special_tokens=False)["input_ids"]
    assert re_encoded != trajectory  # what an implementation that re-tokenises would train on


def test_a_turn_cut_before_its_end_token_gets_the_end_from_the_template(tiny_chat_tokenizer):
    encoder = ConversationEncoder(tiny_chat_tokenizer, TOOLS)
    cut = encoder.observation_ids([{"role": "tool", "content": "7"}], last_generated_id=None)
    assert tiny_chat_tokenizer.decode(cut) == "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_cannot_write_tool_messages_is_refused_at_the_start(tiny_chat_tokenizer):
    strict = make_chat_tokenizer(["hello"])
    strict.chat_template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                            "{{ raise_exception('roles must be user or assistant') }}{% endif %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="cannot write a 'tool' message .*roles must be user or assistant"):
        ConversationEncoder(strict, TOOLS)
    ConversationEncoder(strict)  # without tools nothing asks it to


def test_a_tokenizer_without_a_template_is_refused():
    bare = make_tokenizer(["hello"])
    with pytest.raises(ChatTemplateError, match="multi-turn rollouts need a chat template"):
        ConversationEncoder(bare)


@pytest.mark.parametrize("which", ["tiny_chat_tokenizer", "smollm2_tokenizer"])
def test_an_sft_row_with_tools_is_trained_on_the_prompt_its_episode_samples_from(which, request):
    tokenizer = request.getfixturevalue(which)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is 1234 times 5678"}]
    row = encode_pair(tokenizer, tuple(first), CALL, 512, TOOLS)
    assert row.prompt == ConversationEncoder(tokenizer, TOOLS).prompt_ids(first)
    assert row.response == sampled_turn(tokenizer, CALL)  # the call, then the end of turn the episode stops on
    assert "calculator" in tokenizer.decode(row.prompt)
    assert encode_pair(tokenizer, tuple(first), CALL, 512).prompt != row.prompt  # no tools, no schemas


# A template whose assistant turn ends in plain text, not a special token: the observation starts
# with text, which a SentencePiece tokenizer tokenising it alone would give its dummy-prefix '▁'.
PLAIN_END_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}\nEND{% else %}Q: {{ m.content }} A:"
    "{% endif %}{% endfor %}"
)


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_a_sentencepiece_observation_has_no_dummy_prefix_mid_conversation(scheme):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    specials = ["<unk>", "<pad>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(["what is 1234 times 5678", "the answer END Q: A:", "tool says 42"],
                            trainers.BpeTrainer(vocab_size=320, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = PLAIN_END_TEMPLATE
    first = [{"role": "user", "content": "what is 12 times 17"}]
    answer, observation = {"role": "assistant", "content": "the answer"}, [{"role": "user", "content": "tool says 42"}]
    encoder = ConversationEncoder(tokenizer)
    whole = tokenizer.apply_chat_template([*first, answer, *observation], tokenize=False, add_generation_prompt=True)
    head = tokenizer.apply_chat_template([*first, answer], tokenize=False)[: -len("\nEND")]
    whole_ids, head_ids = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (whole, head))
    assert whole_ids[: len(head_ids)] == head_ids
    tail = whole[len(head):]
    alone = tokenizer(tail, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(alone)[0] == "▁"  # what tokenising the new text alone gives
    assert encoder.observation_ids(observation, head_ids[-1]) == whole_ids[len(head_ids):]
