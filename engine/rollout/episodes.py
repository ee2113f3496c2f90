"""Multi-turn rollouts: each row is an episode with its own environment, sampled in one batch whose
KV cache carries every row across its turns.

The loop is decode's (one token per row per step, the same seeded draw), with two additions. A row
whose turn ends (a stop id, the turn's token cap) hands the turn's text to its environment in a
thread pool, which runs while the batch's next forward does. At the next step its environment's
observation ids (engine/envs/chat.py: only the new messages, in the template's delimiters) are
fed one per step in place of samples, then it samples again. No row waits for another's turn or
episode: one row reads a tool result while others write, and a finished row idles on padding. The
batch does wait, at the step after a turn ends, for that turn's environment step.

Which tokens a row gets depends on the seed, the step counts and the observations only, never on
how long a tool took, so a step's rollout is reproducible given its tools' outputs; `replay` (the
outputs of an earlier run of the same step, in call order) makes it so without running a tool again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlflow.engine.config.env import EnvConfig
from rlflow.engine.config.sampling import SamplingParams
from rlflow.engine.data.batching import left_pad
from rlflow.engine.data.records import PromptRecord
from rlflow.engine.envs.base import EnvStep, Environment, build_environment
from rlflow.engine.envs.chat import ConversationEncoder
from rlflow.engine.models.tokens import stop_token_ids
from rlflow.engine.rollout.decode import next_token, open_steps
from rlflow.engine.rollout.draw import SeededDraw
from rlflow.engine.rollout.generate import RolloutBatch, pad_responses


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    """Model turns per episode; an episode still calling tools after the last is truncated."""
    max_new_tokens: int
    """Tokens per model turn (sampling.max_new_tokens)."""
    max_total_tokens: int
    """Every id after the prompt, model turns and observations together."""
    max_prompt_tokens: int | None = None
    """The first messages' ids kept (their last ones: data.prompt_overflow=truncate); None: all."""


@dataclass(frozen=True)
class Trajectory:
    """One episode as token ids: the prompt, then every id exactly as sampled or observed."""

    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]  # after the prompt, in order: the model's turns and the observations between them
    generated: tuple[bool, ...]  # per id: True where the model sampled it (the loss mask)
    logprobs: tuple[float, ...]  # per id: the sampler's log-prob, 0.0 on observation ids
    answer: str  # the final turn's text (special tokens removed); "" when the episode was truncated
    turns: int
    tool_calls: int
    tool_errors: int
    truncated: bool
    env_reward: float  # the environment's per-turn rewards, summed
    observations: tuple[tuple[int, ...], ...]  # each observation's ids, in the order they were appended

    def summary(self) -> dict[str, float]:
        """The episode's counts (JSON: what ranks gather and episode_metrics averages)."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "truncated": float(self.truncated), "turn_reward": self.env_reward,
                "observation_tokens": len(self.ids) - sum(self.generated)}


def episode_metrics(summaries: Sequence[dict[str, float]], prefix: str) -> dict[str, float]:
    """Means of Trajectory.summary() over episodes, as <prefix><key> ({} without episodes): turns, tool
    calls and errors, the truncated share, the environments' own reward, observation ids."""
    if not summaries:
        return {}
    keys = ("turns", "tool_calls", "tool_errors", "truncated", "turn_reward", "observation_tokens")
    return {f"{prefix}{k}": sum(float(s[k]) for s in summaries) / len(summaries) for k in keys}


@dataclass
class _Episode:
    env: Environment
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    generated: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)  # the model turn being written
    forced: list[int] = field(default_factory=list)  # observation ids still to feed
    observations: list[tuple[int, ...]] = field(default_factory=list)
    turn_ended: bool = False  # set when a turn ends; the loop then hands it to the environment
    turn_text: str = ""
    pending: Future | None = None
    answer: str = ""
    turns: int = 0
    calls: int = 0
    errors: int = 0
    reward: float = 0.0
    done: bool = False
    truncated: bool = False

    def trajectory(self) -> Trajectory:
        return Trajectory(
            tuple(self.prompt), tuple(self.ids), tuple(self.generated), tuple(self.logprobs),
            "" if self.truncated else self.answer, self.turns, self.calls, self.errors, self.truncated,
            self.reward, tuple(self.observations),
        )


@dataclass(frozen=True)
class RecordedStep:
    """An environment's answer to one model turn, and which turn it answered (sha256 of its text)."""

    turn_sha: str
    step: EnvStep


def turn_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class _Replay:
    """The environment steps of an earlier run of this rollout, handed out per row in call order
    while the model writes the same turns; from a row's first other turn on, its environment runs
    (a replayed step answers only the text it answered before)."""

    def __init__(self, steps: dict[int, list[RecordedStep]] | None):
        self.steps = {row: list(s) for row, s in (steps or {}).items()}
        self.record: dict[int, list[RecordedStep]] = {}

    def step(self, row: int, env: Environment, text: str) -> EnvStep:
        queue, sha = self.steps.get(row), turn_sha(text)
        if queue and queue[0].turn_sha == sha:
            result = queue.pop(0).step
        else:
            self.steps[row] = []
            result = env.step(text)
        self.record.setdefault(row, []).append(RecordedStep(sha, result))
        return result


def run_episodes(
    model: torch.nn.Module,
    tokenizer: Any,
    envs: Sequence[Environment],
    first_messages: Sequence[list[dict[str, str]]],
    encoder: ConversationEncoder,
    params: SamplingParams,
    limits: EpisodeLimits,
    stop_ids: Sequence[int],
    seed: int,
    pool: Executor,
    replay: dict[int, list[RecordedStep]] | None = None,
) -> tuple[list[Trajectory], dict[int, list[RecordedStep]]]:
    """Runs one episode per row (envs[i] already reset to first_messages[i]) and returns the
    trajectories and every environment step taken, per row in order (what `replay` takes)."""
    keep = limits.max_prompt_tokens
    episodes = [_Episode(env, encoder.prompt_ids(messages)[-keep if keep else None:])
                for env, messages in zip(envs, first_messages)]
    pad = tokenizer.pad_token_id
    ids, attention = left_pad([e.prompt for e in episodes], pad)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            steps = open_steps(model, attention.to(device), limits.max_total_tokens)
            logits = steps.prefill(ids.to(device))
            draw, width, stops = SeededDraw(seed, device), ids.shape[1], set(stop_ids)
            history = _Replay(replay)
            for slot in range(limits.max_total_tokens):
                sampled, logprob = next_token(logits, params.temperature, params.top_p, draw)
                feed = [_advance(e, int(t), float(lp), stops, limits, tokenizer, pad)
                        for e, t, lp in zip(episodes, sampled.tolist(), logprob.tolist())]
                for row, e in enumerate(episodes):
                    if e.turn_ended:  # its environment runs beside the next forward
                        e.turn_ended, e.pending = False, pool.submit(history.step, row, e.env, e.turn_text)
                if all(e.done for e in episodes) or slot == limits.max_total_tokens - 1:
                    break
                logits = steps.step(torch.tensor(feed, device=device), width + slot)
                _collect(episodes, encoder, limits)
                if all(e.done for e in episodes):
                    break
    finally:
        model.train(was_training)
        _collect(episodes, encoder, limits)  # an environment still running when the budget ran out
    for e in episodes:  # the token budget ran out with turns still open
        if not e.done:
            e.done, e.truncated = True, True
    return [e.trajectory() for e in episodes], history.record


def _advance(e: _Episode, sampled: int, logprob: float, stops: set[int], limits: EpisodeLimits,
             tokenizer: Any, pad: int) -> int:
    """The id row `e` feeds at this step: padding when done, its next observation id, or the sample."""
    if e.done:
        return pad
    if e.forced:
        token = e.forced.pop(0)
        e.ids.append(token)
        e.generated.append(False)
        e.logprobs.append(0.0)
        return token
    e.ids.append(sampled)
    e.generated.append(True)
    e.logprobs.append(logprob)
    e.turn.append(sampled)
    if sampled in stops or len(e.turn) >= limits.max_new_tokens:
        e.turns += 1
        # The environment reads the turn with its special tokens (a tool-call marker may be one), less
        # the stop id; the reward reads it as a single-turn response is read: special tokens removed.
        e.turn_text = tokenizer.decode(e.turn[:-1] if sampled in stops else e.turn)
        e.answer = tokenizer.decode(e.turn, skip_special_tokens=True)
        e.turn = []
        e.turn_ended = True
    elif len(e.ids) >= limits.max_total_tokens:
        e.done, e.truncated = True, True
    return sampled


def _collect(episodes: Sequence[_Episode], encoder: ConversationEncoder, limits: EpisodeLimits) -> None:
    for e in episodes:
        if e.pending is not None:
            step, e.pending = e.pending.result(), None
            _observe(e, step, encoder, limits)


def _observe(e: _Episode, step: EnvStep, encoder: ConversationEncoder, limits: EpisodeLimits) -> None:
    """Takes in the environment's answer to the turn that just ended."""
    e.reward += float(step.reward)
    e.calls += int(step.info.get("tool_calls", 0))
    e.errors += int(step.info.get("tool_errors", 0))
    if step.done:
        e.done = True
        return
    observation = encoder.observation_ids(step.observation, e.ids[-1] if e.generated[-1] else None)
    if e.turns >= limits.max_turns or len(e.ids) + len(observation) >= limits.max_total_tokens:
        e.done, e.truncated = True, True  # no room for another turn
        return
    e.forced = list(observation)
    e.observations.append(tuple(observation))


def trajectory_batch(trajectories: Sequence[Trajectory], pad_id: int, version: int | None = None) -> RolloutBatch:
    """The trajectories as a RolloutBatch: attention on every real id, observations included; the
    response mask (what carries loss, KL and advantages) on the model's ids only."""
    prompt_ids, attention = left_pad([list(t.prompt_ids) for t in trajectories], pad_id)
    rows = [torch.tensor(t.ids, dtype=torch.long) for t in trajectories]
    response = pad_responses([r[None] for r in rows], value=pad_id).long()
    real = pad_responses([torch.ones(1, len(r)) for r in rows])
    mask = pad_responses([torch.tensor(t.generated, dtype=torch.float32)[None] for t in trajectories])
    logprobs = pad_responses([torch.tensor(t.logprobs, dtype=torch.float32)[None] for t in trajectories])
    versions = None if version is None else torch.full((len(trajectories),), version, dtype=torch.long)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, response], 1),
        attention_mask=torch.cat([attention, real.long()], 1),
        response_mask=mask,
        prompt_width=prompt_ids.shape[1],
        response_texts=tuple(t.answer for t in trajectories),
        sampled_logprobs=logprobs * mask,
        sampled_versions=versions,
    )



class Journal(Protocol):
    """Where an RL step's environment steps are kept until the step commits (engine/stages/rl/tool_journal.py)."""

    def replay(self, key: str) -> dict[int, list[RecordedStep]] | None: ...

    def record(self, key: str, steps: dict[int, list[RecordedStep]]) -> None: ...


class EpisodeSampler:
    """The RL stage's and evaluation's sampler when the config has an `env`: one fresh environment
    per row, reset to the row, then `run_episodes`. Keeps the episodes' counts until `metrics()`."""

    def __init__(self, cfg: EnvConfig, tokenizer: Any, journal: Journal | None = None,
                 max_prompt_tokens: int | None = None):
        self.cfg, self.tokenizer, self.journal = cfg, tokenizer, journal
        self.max_prompt_tokens = max_prompt_tokens  # data.max_prompt_tokens: longer first messages keep their end
        probe = build_environment(cfg.fn, cfg.kwargs)
        tools = probe.tool_schemas() if hasattr(probe, "tool_schemas") else []
        self.encoder = ConversationEncoder(tokenizer, tools)
        self.trajectories: list[Trajectory] = []

    def sample(self, policy: torch.nn.Module, records: Sequence[PromptRecord], params: SamplingParams,
               seed: int, journaled: bool = False) -> RolloutBatch:
        """One episode per record. `journaled` (the RL step's rollouts, not evaluations): the
        environment steps are recorded in the journal, and replayed from it when it holds them."""
        key, journal = str(seed), self.journal if journaled else None
        replay = None if journal is None else journal.replay(key)
        envs, first = self._reset(records)
        limits = EpisodeLimits(self.cfg.max_turns, params.max_new_tokens, self.cfg.max_total_tokens,
                               self.max_prompt_tokens)
        stops = stop_token_ids(self.tokenizer)
        with ThreadPoolExecutor(self.cfg.tool_workers, thread_name_prefix="rlflow-env") as pool:
            trajectories, steps = run_episodes(policy, self.tokenizer, envs, first, self.encoder, params, limits,
                                               stops, seed, pool, replay)
        if journal is not None and replay is None:
            journal.record(key, steps)
        self.trajectories.extend(trajectories)
        return trajectory_batch(trajectories, self.tokenizer.pad_token_id)

    def prompt_ids(self, records: Sequence[PromptRecord]) -> list[list[int]]:
        """Each record's episode prompt, whole: its first messages (a fresh environment's `reset`,
        the tool instructions included) as the model reads them. What data.max_prompt_tokens
        measures, and data.prompt_overflow=drop drops by, when the config has an `env`."""
        return [self.encoder.prompt_ids(messages) for messages in self._reset(records)[1]]

    def _reset(self, records: Sequence[PromptRecord]) -> tuple[list[Environment], list[list[dict[str, str]]]]:
        """A fresh environment per record, and its first messages."""
        envs = [build_environment(self.cfg.fn, self.cfg.kwargs) for _ in records]
        return envs, [env.reset({**r.fields, "prompt": r.prompt}) for env, r in zip(envs, records)]

    def take(self) -> list[Trajectory]:
        """The episodes sampled since the last call, in order."""
        done, self.trajectories = self.trajectories, []
        return done
