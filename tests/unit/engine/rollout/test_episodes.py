"""Multi-turn episodes in one batch: the ids trained on are the ids sampled plus the observation ids,
bit for bit; the KV cache carries each row across its turns (the sampler's log-probs are a full
forward's); rows end at different turns; and what a row gets does not depend on how long a tool
took, so a replay of the tools' outputs reproduces the rollout without calling them."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.envs import ScriptedEnv
from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.data.records import PromptRecord, format_prompt
from rlflow.engine.envs.chat import ConversationEncoder
from rlflow.engine.models.loading import token_logprobs
from rlflow.engine.errors import DataError
from rlflow.engine.rollout.episodes import EpisodeLimits, EpisodeSampler, run_episodes, trajectory_batch
from rlflow.engine.data.prompts import encode_prompt_set
from rlflow.engine.tasksets.demo import make_chat_tokenizer, make_tiny_model

CORPUS = ["what is 1234 times 5678", "the answer is 7006652", "result of the tool", "tool says 42 and 17"]


class NoToolsNow:
    def step(self, assistant_message):
        raise AssertionError("a replayed rollout called its environment")


@pytest.fixture(scope="module")
def tiny():
    tokenizer = make_chat_tokenizer(CORPUS)
    return tokenizer, make_tiny_model(tokenizer, seed=1).eval()


def rollout(tiny, envs, seed=0, replay=None, limits=EpisodeLimits(max_turns=4, max_new_tokens=6, max_total_tokens=90)):
    tokenizer, model = tiny
    encoder = ConversationEncoder(tokenizer)
    first = [[{"role": "user", "content": f"what is {i} times 17"}] for i in range(len(envs))]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=limits.max_new_tokens)
    stops = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with ThreadPoolExecutor(4) as pool:
        return run_episodes(model, tokenizer, envs, first, encoder, params, limits, stops, seed, pool, replay)


def test_trained_ids_are_sampled_ids_plus_observation_ids_and_the_cache_carries_across_turns(tiny):
    tokenizer, model = tiny
    envs = [ScriptedEnv(t) for t in (1, 3, 2, 4)]
    trajectories, _ = rollout(tiny, envs)
    encoder = ConversationEncoder(tokenizer)
    assert [t.turns for t in trajectories] == [1, 3, 2, 4] and not any(t.truncated for t in trajectories)
    assert [t.tool_calls for t in trajectories] == [0, 2, 1, 3]
    assert [t.env_reward for t in trajectories] == [0.5, 1.0, 0.75, 1.25]
    for t, env in zip(trajectories, envs):
        observed = [i for i, g in zip(t.ids, t.generated) if not g]
        assert observed == [i for o in t.observations for i in o]
        # Each observation is the encoder's ids for that tool message after the turn before it.
        starts = [k for k in range(1, len(t.ids)) if not t.generated[k] and t.generated[k - 1]]
        for start, obs, n in zip(starts, t.observations, range(1, 9)):
            expected = encoder.observation_ids([{"role": "tool", "content": f"tool says {n * 17}"}], t.ids[start - 1])
            assert list(obs) == expected and list(t.ids[start:start + len(obs)]) == expected
        assert env.seen[-1] == t.answer and len(env.seen) == t.turns
    batch = trajectory_batch(trajectories, tokenizer.pad_token_id)
    for row, t in enumerate(trajectories):
        real = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert real == list(t.prompt_ids) + list(t.ids)  # bit for bit what was sampled and observed
        assert batch.response_mask[row, :len(t.ids)].tolist() == [float(g) for g in t.generated]
    # The sampler's log-probs equal a full forward over the finished sequences: every observation
    # sat at the right positions of the cache and every turn saw the whole conversation.
    full, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width, 1.0)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(full[mask], batch.sampled_logprobs[mask], atol=1e-4, rtol=0)


def test_what_a_row_gets_does_not_depend_on_tool_timing_and_a_replay_calls_no_tool(tiny):
    fast, record = rollout(tiny, [ScriptedEnv(t) for t in (2, 3, 1)], seed=5)
    slow, _ = rollout(tiny, [ScriptedEnv(t, delay_s=d) for t, d in zip((2, 3, 1), (0.05, 0.0, 0.1))], seed=5)
    assert fast == slow
    replayed, again = rollout(tiny, [NoToolsNow() for _ in range(3)], seed=5, replay=record)
    assert replayed == fast and again == record


def test_a_replayed_step_answers_only_the_turn_it_answered_before(tiny):
    _, record = rollout(tiny, [ScriptedEnv(3)], seed=5)
    stale = {0: [dataclasses.replace(r, turn_sha="another turn") if i == 1 else r for i, r in enumerate(record[0])]}
    env = ScriptedEnv(3)
    env.seen = ["turn 1"]  # as if it had answered the replayed first turn
    trajectories, again = rollout(tiny, [env], seed=5, replay=stale)
    assert len(env.seen) == 3  # turns 2 and 3 were answered by the environment, not the record
    assert [r.turn_sha for r in again[0]] == [r.turn_sha for r in record[0]]


def test_an_episode_past_its_turns_or_tokens_is_truncated_with_no_answer(tiny):
    trajectories, _ = rollout(tiny, [ScriptedEnv(99), ScriptedEnv(1)],
                              limits=EpisodeLimits(max_turns=2, max_new_tokens=5, max_total_tokens=90))
    endless, done = trajectories
    assert endless.truncated and endless.turns == 2 and endless.answer == ""
    assert not done.truncated and done.turns == 1 and done.answer != ""
    tight = EpisodeLimits(max_turns=9, max_new_tokens=5, max_total_tokens=12)
    short, _ = rollout(tiny, [ScriptedEnv(99)], limits=tight)
    assert short[0].truncated and len(short[0].ids) <= 12


def test_max_prompt_tokens_measures_and_truncates_the_first_messages_with_the_tool_instructions(tiny):
    tokenizer, model = tiny
    cfg = EnvConfig(fn="rlflow.engine.envs.tool_env:ToolEnv", kwargs={"tools": ["calculator"]}, max_turns=2,
                    max_total_tokens=24)
    records = [PromptRecord(f"what is {'1234 ' * n}times 17", {}) for n in (1, 4)]
    whole = EpisodeSampler(cfg, tokenizer).prompt_ids(records)
    plain = [len(tokenizer(format_prompt(tokenizer, r.prompt), add_special_tokens=False)["input_ids"]) for r in records]
    assert [len(w) > p for w, p in zip(whole, plain)] == [True, True]  # the tool instructions count
    limit = (len(whole[0]) + len(whole[1])) // 2  # the short episode fits, the long one does not
    kept, n_trunc, n_drop = encode_prompt_set(tokenizer, records, limit, "drop", "prompts.jsonl",
                                              EpisodeSampler(cfg, tokenizer, None, limit))
    assert (kept.records, n_trunc, n_drop) == ((records[0],), 0, 1)
    sampler = EpisodeSampler(cfg, tokenizer, None, limit)
    kept, n_trunc, n_drop = encode_prompt_set(tokenizer, records, limit, "truncate", "prompts.jsonl", sampler)
    assert (len(kept.records), n_trunc, n_drop) == (2, 1, 0)
    assert [list(t) for t in kept.token_ids] == [whole[0], whole[1][-limit:]]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)
    sampler.sample(model, kept.records, params, seed=0)
    assert [list(t.prompt_ids) for t in sampler.take()] == [list(t) for t in kept.token_ids]
    with pytest.raises(DataError, match=r"prompts.jsonl: every prompt, as an episode's .* data.max_prompt_tokens=3 "):
        encode_prompt_set(tokenizer, records, 3, "drop", "prompts.jsonl", EpisodeSampler(cfg, tokenizer, None, 3))
