"""The tool-use demo task: its gold rule, the sloppy annotator (guesses and mistyped calls at the
configured shares, a guess never right), its assets (deterministic, held-out problems held out, one
SFT row per demonstration) and SFT rows that are token for token the ids an episode lays out, with
each assistant turn learned."""

import json
import random
import re

import pytest
from transformers import AutoTokenizer

from rlflow.engine.config.stages import SFTConfig
from rlflow.engine.data.records import load_sft_examples
from rlflow.engine.envs.chat import ConversationEncoder
from rlflow.engine.envs.tool_calls import parse_hermes
from rlflow.engine.envs.tools import CALCULATOR, calculator
from rlflow.engine.stages.sft import encode_sft_example
from rlflow.engine.tasksets.calculator import (
    GUESS_SHARE,
    WRONG_ARGUMENTS_SHARE,
    call_text,
    demonstration,
    gold_score,
    guess,
    make_tools_assets,
    mistype,
)

SIZES = {"sft": 400, "sft_eval": 40, "prompts": 100, "eval_prompts": 60}
TINY = {"hidden": 16, "layers": 1}
QUESTION = re.compile(r"what is (\d+) ([+*]) (\d+) \?")


def rows(assets, name):
    return [json.loads(line) for line in (assets / "data" / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_tools_assets(tmp_path_factory.mktemp("tools"), seed=5, sizes=SIZES, model=TINY)


def test_gold_rule_by_hand():
    assert gold_score("q", " 4821 ", answer="4821") == {"score": 1.0, "valid": 1.0}
    assert gold_score("q", "4,821", answer="4821") == {"score": 0.0, "valid": 0.0}
    assert gold_score("q", "4822", answer="4821") == {"score": 0.0, "valid": 1.0}
    assert gold_score("q", call_text("1 + 2"), answer="3")["score"] == 0.0  # a call is not an answer


def test_a_guess_keeps_the_leading_digits_and_is_never_right_and_a_typo_changes_one_digit():
    rng = random.Random(0)
    for answer in (101, 4821, 9999, 35_246_798):
        for _ in range(50):
            value = str(guess(answer, rng))
            assert value != str(answer) and len(value) == len(str(answer))
            assert value[: len(str(answer)) // 2] == str(answer)[: len(str(answer)) // 2]
    for number in (100, 9999, 4821):
        for _ in range(50):
            typo = str(mistype(number, rng))
            assert len(typo) == len(str(number)) and typo[0] != "0"
            assert sum(x != y for x, y in zip(typo, str(number))) == 1


def test_the_annotator_guesses_and_mistypes_at_its_shares():
    rng, n = random.Random(1), 4000
    kinds = {"guess": 0, "mistyped": 0, "right": 0}
    for _ in range(n):
        a, op, b = rng.randint(100, 9999), rng.choice("+*"), rng.randint(100, 9999)
        conversation = demonstration((a, op, b), rng)
        truth = calculator(f"{a} {op} {b}")
        if len(conversation) == 2:
            kinds["guess"] += 1
            assert conversation[1]["content"] != truth
            continue
        user, call, tool, final = conversation
        assert [t["role"] for t in conversation] == ["user", "assistant", "tool", "assistant"]
        (parsed,) = parse_hermes(call["content"]).calls
        assert parsed.name == "calculator" and final["content"] == tool["content"]
        assert tool["content"] == calculator(parsed.arguments["expression"])  # the annotator trusts the tool
        kinds["right" if final["content"] == truth else "mistyped"] += 1
    spread = 4 * (0.25 / n) ** 0.5  # four standard errors of a share
    assert abs(kinds["guess"] / n - GUESS_SHARE) < spread
    assert abs(kinds["mistyped"] / n - WRONG_ARGUMENTS_SHARE) < spread


def test_assets_are_deterministic_and_held_out_problems_are_held_out(assets, tmp_path):
    again = make_tools_assets(tmp_path / "again", seed=5, sizes=SIZES, model=TINY)
    for name in ("sft", "sft_eval", "prompts", "eval_prompts"):
        assert rows(assets, name) == rows(again, name)
    question = lambda text: QUESTION.fullmatch(text).groups()  # noqa: E731
    train = {question(r["prompt"]) for r in rows(assets, "prompts")}
    train |= {question(r["messages"][0]["content"]) for r in rows(assets, "sft")}
    held = [question(r["prompt"]) for r in rows(assets, "eval_prompts")]
    held += [question(r["messages"][0]["content"]) for r in rows(assets, "sft_eval")]
    assert len(held) >= SIZES["eval_prompts"] and not train & set(held)
    for row in rows(assets, "eval_prompts"):
        a, op, b = question(row["prompt"])
        assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    sft = rows(assets, "sft")
    assert all(r["tools"] == [CALCULATOR.schema()] and r["messages"][-1]["role"] == "assistant" for r in sft)
    turns = [len(r["messages"]) for r in sft]
    assert len(sft) == SIZES["sft"] and set(turns) == {2, 4}  # one row a demonstration: a guess, or call + answer


def test_sft_rows_are_the_ids_an_episode_lays_out_and_learn_each_assistant_turn(assets):
    tokenizer = AutoTokenizer.from_pretrained(assets / "tiny-model")
    encoder = ConversationEncoder(tokenizer, [CALCULATOR.schema()])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = load_sft_examples(str(assets / "data" / "sft.jsonl"))
    encoders: dict = {}
    for example in examples[:200]:
        row = encode_sft_example(tokenizer, example, SFTConfig(max_seq_tokens=512), encoders)
        turns = [*example.prompt, {"role": "assistant", "content": example.response}]
        ids = encoder.prompt_ids(turns[:1])  # the episode: its first messages, then ids only appended
        learned = encode(turns[1]["content"]) + [end]
        ids += learned
        if len(turns) == 4:
            ids += encoder.observation_ids(turns[2:3], end) + encode(turns[3]["content"]) + [end]
            learned += encode(turns[3]["content"]) + [end]
        assert row.prompt + row.response == ids
        assert [i for i, m in zip(row.response, row.response_mask()) if m] == learned
    number = tokenizer("4821", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(number) == list("4821")  # digit by digit


def test_demo_assets_command_builds_the_tools_task(tmp_path, capsys):
    from rlflow.flows.cli.main import main

    assert main(["demo-assets", "--task", "tools", str(tmp_path / "tools"), "--seed", "3"]) == 0
    out = tmp_path / "tools"
    assert capsys.readouterr().out.strip() == str(out)
    assert all((out / "data" / f"{n}.jsonl").is_file() for n in ("sft", "sft_eval", "prompts", "eval_prompts"))
    assert (out / "tiny-model" / "tokenizer.json").is_file() and (out / "ASSETS_OK").is_file()
