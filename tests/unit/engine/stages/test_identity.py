"""A stage's identity from its inputs record, on hand-made records: marked fields left out, files,
models and functions by content, secrets never in it, upstream inputs by their identities, the hash
independent of key order, and the keys two trees differ in."""

import hashlib
from typing import Annotated, Any, Literal

from rlflow.engine.config.base import Section, SectionView, by_content, neutral, wiring
from rlflow.engine.stages.context import Record
from rlflow.engine.stages.identity import IDENTITY_FORMAT, ContentHasher, changed_keys, identity_of, identity_tree
from rlflow.engine.stages.inputs import ModelInput, StageInputs


class Knobs(Section):
    lr: float = 0.1
    log_every: Annotated[int, neutral("logging")] = 10
    rounds: Annotated[list[int], wiring("the flow's")] = [0]
    data: Annotated[str | None, by_content("file")] = None
    fn: Annotated[str, by_content("function")] = "rlflow.engine.tasksets.demo:gold_score"
    kwargs: Annotated[dict[str, Any], by_content("kwargs")] = {}
    storage_options: dict[str, Any] = {}
    mode: Literal["a", "b"] = "a"


class Part(SectionView, source=Knobs):
    lr: float
    log_every: int


class Up(Record):
    init: ModelInput


class Inputs(StageInputs):
    upstream: Up
    knobs: Knobs
    part: Part


def tree(tmp_path=None, **knobs) -> dict:
    k = Knobs(**knobs)
    inputs = Inputs(seed=0, upstream=Up(init=ModelInput(uri="/anywhere", identity="m-1")), knobs=k, part=Part.of(k))
    return identity_tree("x", inputs, ContentHasher())


def sha(path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_marked_fields_secrets_and_locations_stay_out_and_views_keep_their_sections_marks():
    base = tree()
    assert base["format"] == IDENTITY_FORMAT and base["stage"] == "x" and base["seed"] == 0
    assert base["upstream"] == {"init": "m-1"}  # its identity, not its URI
    assert set(base["knobs"]) == {"lr", "data", "fn", "kwargs", "mode"}  # no log_every, rounds, storage_options
    assert base["part"] == {"lr": 0.1}  # the view's log_every is the section's: neutral
    assert identity_of(tree(log_every=3, rounds=[0, 1], storage_options={"key": "AKIA"})) == identity_of(base)
    assert identity_of(tree(lr=0.2)) != identity_of(base) and identity_of(tree(mode="b")) != identity_of(base)


def test_files_and_functions_enter_by_content_and_kwargs_naming_files_too(tmp_path):
    first, copy, other = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    first.write_text('{"prompt": "x"}\n')
    copy.write_text('{"prompt": "x"}\n')
    other.write_text('{"prompt": "y"}\n')
    t = tree(data=str(first))
    assert t["knobs"]["data"] == sha(first)
    assert identity_of(tree(data=str(copy))) == identity_of(t) != identity_of(tree(data=str(other)))
    demo = __import__("rlflow.engine.tasksets.demo", fromlist=["x"]).__file__
    assert t["knobs"]["fn"] == "rlflow.engine.tasksets.demo:gold_score@" + sha(__import__("pathlib").Path(demo))
    named = tree(kwargs={"weights": str(first), "scale": 2, "api_key": "sk-1", "nested": [str(other)]})
    assert named["knobs"]["kwargs"] == {"weights": sha(first), "scale": 2, "nested": [sha(other)]}  # no api_key
    assert identity_of(tree(kwargs={"weights": str(copy)})) == identity_of(tree(kwargs={"weights": str(first)}))


def test_an_identity_is_the_trees_content_whatever_its_key_order_and_changes_are_named():
    a = {"format": 2, "rl": {"steps": 3, "clip_ratio": 0.2}, "upstream": {"policy": "a"}}
    b = {"upstream": {"policy": "a"}, "rl": {"clip_ratio": 0.2, "steps": 3}, "format": 2}
    assert identity_of(a) == identity_of(b) and len(identity_of(a)) == 64
    changed = {"format": 2, "rl": {"steps": 4, "clip_ratio": 0.2}, "upstream": {"policy": "b"}}
    assert set(changed_keys(a, changed)) == {"rl.steps", "upstream.policy"}
    assert changed_keys(a, b) == ("(inputs)",)
    assert changed_keys({"config": {}}, a) == ("(identity format 1 -> 2)",)  # an rlflow 0.1 tree


def test_a_function_that_cannot_be_found_is_a_config_error_naming_its_key():
    import pytest

    from rlflow.engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"knobs.fn: module 'no_such_module' of 'no_such_module:f' cannot be found"):
        tree(fn="no_such_module:f")
