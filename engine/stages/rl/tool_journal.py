"""The environment steps (tool outputs) of the RL steps in progress, kept in the stage's store until a
checkpoint at or after them commits. A step killed after its tools ran is rerun with their outputs replayed instead
of calling the tools again: a tool may be slow, costly or not deterministic (a clock, a remote
judge), and the rerun's tokens, and so its weights, must be the killed run's.

One file per step and rank, `inflight/tools_step_<n>_rank_<r>.json`: {identity, rollouts: {key:
{row: [{turn: sha256 of the turn's text, step: EnvStep as JSON}, ...]}}}, rewritten after each chunk's episodes. A file of another identity
(a config changed under resume.allow_config_change) is not replayed, and a recorded step answers
only the turn text it answered (a rerun on other weights, after an operator's rollback, calls the
environment for the turns that differ).
"""

from __future__ import annotations

import dataclasses
import re

from rlflow.engine.envs.base import EnvStep
from rlflow.engine.rollout.episodes import RecordedStep
from rlflow.engine.storage.checkpoint import CheckpointStore

_NAME = re.compile(r"^tools_step_(\d+)_rank_(\d+)\.json$")


class ToolJournal:
    def __init__(self, store: CheckpointStore, identity: str, rank: int):
        self.store, self.identity, self.rank = store, identity, rank
        self.step: int | None = None
        self.rollouts: dict[str, dict[str, list[dict]]] = {}

    def _name(self, step: int) -> str:
        return f"tools_step_{step:06d}_rank_{self.rank}.json"

    def begin(self, step: int) -> None:
        """Step `step` starts: the records of steps a committed checkpoint holds go (a rerun starts
        after them), and this step's, if a killed run left one, is loaded for replay."""
        committed = self.store.latest() or 0
        for name in self.store.inflight_names():
            match = _NAME.match(name)
            if match and int(match.group(1)) <= committed and int(match.group(2)) == self.rank:
                self.store.remove_inflight(name)
        saved = self.store.read_inflight(self._name(step))
        valid = isinstance(saved, dict) and saved.get("identity") == self.identity
        self.step, self.rollouts = step, dict(saved["rollouts"]) if valid else {}

    def replay(self, key: str) -> dict[int, list[RecordedStep]] | None:
        """The recorded steps of rollout `key` (a chunk's sampling seed) per row, or None."""
        rows = self.rollouts.get(key)
        if rows is None:
            return None
        return {int(row): [RecordedStep(s["turn"], EnvStep(**s["step"])) for s in steps] for row, steps in rows.items()}

    def clear(self) -> None:
        """The stage ended: no step is in flight (a killed stage never gets here, so its record stays)."""
        for name in self.store.inflight_names():
            match = _NAME.match(name)
            if match and int(match.group(2)) == self.rank:
                self.store.remove_inflight(name)
        self.step, self.rollouts = None, {}

    def record(self, key: str, steps: dict[int, list[RecordedStep]]) -> None:
        if self.step is None:
            raise RuntimeError("ToolJournal.record before begin(step)")
        self.rollouts[key] = {
            str(row): [{"turn": r.turn_sha, "step": dataclasses.asdict(r.step)} for r in recorded]
            for row, recorded in steps.items()
        }
        self.store.write_inflight(self._name(self.step), {"identity": self.identity, "rollouts": self.rollouts})
