"""reasoning-gym tasks (engine/tasksets/gym.py): prompt files from disjoint seeds, the verifier as a
reward source in the real worker pool (right, wrong, malformed, raising, timed out) and as gold."""

import json

import pytest

from rlflow.engine.config.methods import RewardSourceConfig
from rlflow.engine.data.records import load_prompts
from rlflow.engine.errors import ConfigError
from rlflow.engine.tasksets.gym import extract_answer, gym_gold, gym_labeller, write_gym_dataset
from rlflow.engine.rewards.pool import RewardFunctionPool

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


@pytest.fixture(scope="module")
def gym_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("gym")
    written = write_gym_dataset("chain_sum", str(out), 200, 64, 5, CHAIN, "answer_tag")
    return written, load_prompts(written["paths"]["prompts"]), load_prompts(written["paths"]["eval_prompts"])


def test_held_out_prompts_come_from_far_seeds_and_never_repeat_training_questions(gym_files):
    written, train, heldout = gym_files
    assert (written["train"], written["heldout"]) == (200, 64) and len(train) == 200 and len(heldout) == 64
    assert not {r.fields["gym_question"] for r in heldout} & {r.fields["gym_question"] for r in train}
    row = heldout[0]
    assert row.prompt.endswith("\nGive your final answer inside <answer></answer> tags.")
    assert row.prompt.startswith(row.fields["gym_question"])
    assert row.fields["gym_dataset"] == "chain_sum" and row.fields["gym_config"] == CHAIN
    expression = row.fields["gym_metadata"]["expression"]
    assert str(eval(expression)) == row.fields["answer"]  # noqa: S307 - the generator's own arithmetic
    sft = [json.loads(line) for line in open(written["paths"]["sft"])]
    assert sft[0] == {"prompt": train[0].prompt, "response": f"<answer>{train[0].fields['answer']}</answer>"}


def test_answer_extraction():
    assert extract_answer("so <answer>1</answer> no, <answer> 12 </answer>.", "answer_tag") == "12"
    assert extract_answer("<answer> </answer>", "answer_tag") is None
    assert extract_answer("it is 1,024 or -3.5 apples", "last_number") == "-3.5"
    assert extract_answer("7 + 5 = 1,024", "last_number") == "1024"
    assert extract_answer("no digits", "last_number") is None
    assert extract_answer("  x \n", "full") == "x"


def test_gold_counts_only_full_credit_as_accurate(gym_files):
    row = gym_files[2][0]
    answer = row.fields["answer"]
    right = gym_gold(row.prompt, f"Sum: <answer>{answer}</answer>", **row.fields)
    assert right == {"score": 1.0, "mean_score": 1.0, "lenient": 1.0, "valid": 1.0}
    near = gym_gold(row.prompt, f"<answer>{answer}1</answer>", **row.fields)  # reasoning-gym's partial credit
    assert near["score"] == 0.0 and 0 < near["mean_score"] < 1 and near["valid"] == 1.0
    untagged = gym_gold(row.prompt, f"The total is {answer}", **row.fields)
    assert untagged == {"score": 0.0, "mean_score": 0.0, "lenient": 1.0, "valid": 0.0}
    strict_number = gym_gold(row.prompt, f"The total is {answer}", extract="last_number", **row.fields)
    assert strict_number["score"] == 1.0


def test_the_labeller_prefers_the_right_answer_and_ties_the_rest(gym_files):
    row = gym_files[2][1]
    answer = row.fields["answer"]
    right, wrong = f"<answer>{answer}</answer>", f"<answer>{answer}1</answer>"  # wrong scores partial credit
    label = lambda a, b: gym_labeller(row.prompt, a, b, **row.fields)  # noqa: E731
    assert (label(right, wrong), label(wrong, right)) == (0, 1)
    assert label(right, f"so <answer>{answer}</answer>") is None  # both right
    assert label(wrong, "no tags") is None  # both wrong, whatever the partial credit
    off_by_one = f"= {int(answer) + 1}"
    assert gym_labeller(row.prompt, f"= {answer}", off_by_one, extract="last_number", **row.fields) == 0


def gym_source(**extra):
    return RewardSourceConfig(name="correct", type="gym", kwargs={"extract": "answer_tag", **extra})


def test_the_verifier_in_the_worker_pool_scores_skips_and_never_raises(gym_files):
    rows = gym_files[2][:6]
    fields = [dict(r.fields) for r in rows]
    fields[4]["gym_config"] = {"no_such_option": 1}  # the verifier cannot be built: it raises
    fields[5]["gym_dataset"] = "no_such_dataset"
    answers = [r.fields["answer"] for r in rows]
    responses = [
        f"<answer>{answers[0]}</answer>",  # right
        f"<answer>{answers[1]}1</answer>",  # wrong, with partial credit
        f"I think it is {answers[2]}",  # malformed: no tag
        "<answer>banana</answer>",  # wrong
        f"<answer>{answers[4]}</answer>",
        f"<answer>{answers[5]}</answer>",
    ]
    prompts = [r.prompt for r in rows]
    # on_error stays at the pool's "fail": a gym source skips by itself
    partial = RewardSourceConfig(name="partial", type="gym", kwargs={"credit": "partial"})
    with RewardFunctionPool([gym_source(), partial], workers=2, timeout_s=5.0, on_error="fail") as pool:
        result = pool.submit(prompts, responses, fields).result(timeout=60)
    assert result.scores["correct"] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert result.scores["partial"][0] == 1.0 and 0 < result.scores["partial"][1] < 1
    assert result.scores["partial"][3] < 1.0
    assert result.skipped == {"correct": 3, "partial": 3}  # malformed, raising config, unknown dataset
    assert "MalformedAnswer" in result.errors["correct"] and "sample 2" in result.errors["correct"]


def test_a_timed_out_verifier_scores_zero_and_is_counted(gym_files):
    rows = gym_files[2][:3]
    responses = [f"<answer>{r.fields['answer']}</answer>" for r in rows]
    # 1 microsecond: every verifier call outlasts it (the pool also checks the clock after a call)
    with RewardFunctionPool([gym_source()], workers=1, timeout_s=1e-6, on_error="fail") as pool:
        result = pool.submit([r.prompt for r in rows], responses, [r.fields for r in rows]).result(timeout=60)
    assert result.scores["correct"] == [0.0, 0.0, 0.0] and result.skipped == {"correct": 3}
    assert "exceeded reward.timeout_s" in result.errors["correct"]


def test_an_explicit_on_error_fail_stops_on_a_malformed_answer(gym_files):
    from rlflow.engine.errors import RewardSourceError

    row = gym_files[2][0]
    strict = RewardSourceConfig(name="correct", type="gym", on_error="fail")
    with RewardFunctionPool([strict], workers=1, timeout_s=5.0, on_error="skip") as pool:
        with pytest.raises(RewardSourceError, match="MalformedAnswer"):
            pool.submit([row.prompt], ["no tag"], [row.fields]).result(timeout=60)


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("chain_sumx", {}, "unknown gym dataset 'chain_sumx'; valid: ab, acre,"),
        ("chain_sum", {"foo": 1}, "gym dataset 'chain_sum' has no config key 'foo'; valid: min_terms, max_terms,"),
        ("chain_sum", {"min_terms": 5, "max_terms": 2}, "rejects config {'min_terms': 5, 'max_terms': 2}: max_terms"),
    ],
)
def test_bad_dataset_names_and_configs_are_refused_before_anything_is_written(tmp_path, name, config, message):
    with pytest.raises(ConfigError) as info:
        write_gym_dataset(name, str(tmp_path / "out"), 10, 4, 0, config)
    assert message in str(info.value)
    assert not (tmp_path / "out").exists()


def test_python_tool_demonstrations_call_the_question_and_answer_with_its_output(tmp_path):
    from rlflow.engine.envs.tool_env import ToolEnv

    written = write_gym_dataset("chain_sum", str(tmp_path), 40, 8, 3, CHAIN, "last_number", tool="python")
    env = ToolEnv(tools=["python"])
    for key in ("sft", "sft_eval"):
        rows = [json.loads(line) for line in open(written["paths"][key])]
        prompts = load_prompts(written["paths"]["prompts" if key == "sft" else "eval_prompts"])
        assert len(rows) == len(prompts) and rows[0]["tools"] == env.tool_schemas()
        for row, prompt in zip(rows, prompts):
            user, call, result, answer = row["messages"]
            assert user == {"role": "user", "content": prompt.prompt}
            (parsed,) = env.parse(call["content"]).calls  # the hermes call the episode will read
            code = parsed.arguments["code"]
            expression = code.removeprefix("print(").removesuffix(")")
            assert expression in prompt.fields["gym_question"]
            assert result["role"] == "tool" and result["content"] == str(eval(expression)) == prompt.fields["answer"]
            assert answer == {"role": "assistant", "content": prompt.fields["answer"]}


def test_python_tool_demonstrations_of_a_question_without_arithmetic_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--tool python: leg_counting's question .* does not end in an arithmetic"):
        write_gym_dataset("leg_counting", str(tmp_path / "out"), 4, 2, 0, {}, "last_number", tool="python")
    with pytest.raises(ConfigError, match="unknown demonstration tool 'bash'; valid: python"):
        write_gym_dataset("chain_sum", str(tmp_path / "out"), 4, 2, 0, CHAIN, "last_number", tool="bash")
    assert not (tmp_path / "out").exists()


def test_a_sloppy_annotator_guesses_or_mistypes_its_flawed_share_and_trusts_the_tool(tmp_path):
    written = write_gym_dataset("chain_sum", str(tmp_path), 400, 8, 1, CHAIN, "last_number", tool="python", flawed=0.5)
    rows = [json.loads(line)["messages"] for line in open(written["paths"]["sft"])]
    prompts = load_prompts(written["paths"]["prompts"])
    kinds = {"right": 0, "guess": 0, "mistype": 0}
    for messages, prompt in zip(rows, prompts):
        answer = prompt.fields["answer"]
        if len(messages) == 2:  # a guess: no call, never the answer
            assert messages[1]["role"] == "assistant" and messages[1]["content"] != answer
            kinds["guess"] += 1
            continue
        _, call, result, final = messages
        expression = json.loads(call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        expression = expression["arguments"]["code"].removeprefix("print(").removesuffix(")")
        assert result["content"] == str(eval(expression)) == final["content"]  # it answers what the tool printed
        asked = prompt.fields["gym_question"].rsplit(":", 1)[1].rstrip("= ").strip()
        if expression == asked:
            assert final["content"] == answer
            kinds["right"] += 1
        else:  # one digit of one operand changed
            assert len(expression) == len(asked) and sum(a != b for a, b in zip(expression, asked)) == 1
            kinds["mistype"] += 1
    assert abs(kinds["right"] / 400 - 0.5) < 0.08 and abs(kinds["guess"] / 400 - 0.3) < 0.07
    assert abs(kinds["mistype"] / 400 - 0.2) < 0.06
    with pytest.raises(ConfigError, match="--flawed 1.5: a share in"):
        write_gym_dataset("chain_sum", str(tmp_path / "x"), 4, 2, 0, CHAIN, "last_number", tool="python", flawed=1.5)
