"""Environments named in configs by reference ("helpers.envs:ScriptedEnv"): deterministic episodes of
a known number of turns, whatever the (random-weight) model writes."""

import time

from rlflow.engine.envs.base import EnvStep


class ScriptedEnv:
    """Answers `turns - 1` model turns with a tool message, then ends; sleeps `delay_s` per step. A row's
    `turns` column, when present, overrides the kwarg."""

    def __init__(self, turns: int = 2, delay_s: float = 0.0):
        self.turns, self.delay_s, self.seen = turns, delay_s, []

    def reset(self, row):
        self.turns = int(row.get("turns", self.turns))
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message):
        time.sleep(self.delay_s)
        self.seen.append(assistant_message)
        if len(self.seen) >= self.turns:
            return EnvStep(done=True, reward=0.5)
        return EnvStep(observation=[{"role": "tool", "content": f"tool says {len(self.seen) * 17}"}], reward=0.25,
                       info={"tool_calls": 1.0, "tool_errors": 0.0})


class BadToolEnv:
    """Defines a tool whose schema gives an argument a type JSON schema does not have."""

    def __init__(self):
        from rlflow.engine.envs.tools import Tool

        schema = {"type": "object", "properties": {"x": {"type": "float"}}}
        self.tools = [Tool("scale", "multiply by two", schema, lambda x: str(2 * x))]

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message):
        raise NotImplementedError


class StepTakesNothing:
    def reset(self, row):
        return []

    def step(self):
        raise NotImplementedError


class CountingEnv:
    """Two turns; each call appends a line to `log`, and its tool message names how many calls the log
    held when the environment was built. A step whose tools ran again after a restart would read
    other messages, so sample other tokens."""

    def __init__(self, log: str):
        self.log = log
        with open(log, "a+") as f:
            f.seek(0)
            self.calls_before = len(f.readlines())
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, assistant_message):
        with open(self.log, "a") as f:
            f.write(assistant_message.replace("\n", " ") + "\n")
        self.turns += 1
        if self.turns >= 2:
            return EnvStep(done=True)
        return EnvStep(observation=[{"role": "tool", "content": f"result {self.calls_before}"}],
                       info={"tool_calls": 1.0})


class LongerScriptedEnv(ScriptedEnv):
    """ScriptedEnv with one more turn by default: another environment class taking the same kwargs."""

    def __init__(self, turns: int = 3, delay_s: float = 0.0):
        super().__init__(turns, delay_s)
