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
