"""The config reference is generated from the schema: every key has a description (the checker
catches a planted undocumented field), docs/config.md is exactly what `rlflow config --markdown`
writes now, the walker reads real keys right, and `rlflow config --help-keys PREFIX` works."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from rlflow.engine.config.base import Section
from rlflow.engine.config.methods import ALGORITHMS, SOURCE_TYPES
from rlflow.engine.config.schema import Config
from rlflow.engine.config.kl import KLConfig
from rlflow.engine.errors import ConfigError
from rlflow.flows.cli.config_keys import REGENERATE, command_config, key_rows, render_markdown, undocumented

ROOT = Path(__file__).parents[4]


class PlantedInner(Section):
    documented: int = 1
    """This one has a description."""
    bare: int = 2


class PlantedOuter(Section):
    inner: PlantedInner = Field(default_factory=PlantedInner)
    """A nested section, itself documented."""
    name: str = "x"


@pytest.fixture(scope="module")
def rows():
    return {row.key: row for row in key_rows()}


def test_every_config_key_has_a_description():
    missing = undocumented(Config)
    assert not missing, (
        f"config keys without a description: {', '.join(missing)}; write a docstring under each field"
        f" (engine/config/), then run `{REGENERATE}`"
    )


def test_the_description_check_finds_an_undocumented_field():
    assert undocumented(PlantedOuter) == ["inner.bare", "name"]
    assert PlantedInner.model_fields["documented"].description == "This one has a description."


def test_docs_config_md_is_the_generated_reference():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == render_markdown(), f"docs/config.md differs from the schema: run `{REGENERATE}`"


def test_every_table_row_has_four_cells():
    for line in render_markdown().splitlines():
        if line.startswith("| `"):
            assert len(re.split(r"(?<!\\)\|", line)) == 6, line  # an unescaped | would add a cell


def test_walker_reads_types_defaults_and_constraints(rows):
    grad = rows["rl.max_grad_norm"]
    assert (grad.type, grad.default, grad.constraints) == ("float", "1.0", "> 0")
    assert rows["kl.stop_above"].type == "float | None" and rows["kl.stop_above"].default == "0.3"
    modes = "'token-mean' | 'seq-mean-token-sum' | 'seq-mean-token-mean' | 'seq-mean-token-sum-norm'"
    assert rows["rl.loss_agg"].type == modes
    assert rows["engine.zero_stage"].type == "1 | 2 | 3" and rows["engine.zero_stage"].default == "2"
    assert rows["run.rounds"].constraints == ">= 1, <= 1000"
    assert rows["data.max_prompt_tokens"].constraints == ">= 1"
    assert rows["label.eval_fraction"].constraints == ">= 0, < 1"
    assert rows["sft.rounds"].type == "list[int]" and rows["sft.rounds"].default == "[0]"  # a default factory
    assert rows["run.name"].default == "null" and rows["run.root"].default == "runs"
    assert rows["dpo.lr"].default == "5.0e-05"


def test_walker_descends_into_sections_and_keeps_function_refs_whole(rows):
    assert rows["stage.rl.retries"].type == "int | None" and rows["stage.rl.retries"].default == "null"
    assert "stage.rl" not in rows  # a plain section: only its keys
    assert rows["model.lora"].type == "mapping | None" and rows["model.lora.r"].default == "8"
    assert rows["model.lora.target_modules"].type == "list[str] | 'all-linear'"
    assert rows["reward.sources[].name"].default == "required"
    assert rows["reward.sources"].default.startswith("[{name: rm, type: model")
    assert rows["stage.rl.retries"].type == "int | None"
    labeller = rows["label.labeller"]
    assert labeller.type == "{fn, kwargs}" and "noise: 0.1" in labeller.default
    assert not [key for key in rows if key.startswith(("label.labeller.", "gold."))]
    assert rows["reward.fallback_rule"].type == "{fn, kwargs} | None"


def test_descriptions_list_the_valid_values_of_str_keys_checked_by_validators(rows):
    # algorithm.name and reward.sources[].type are str fields with a validator, not Literals: their
    # descriptions must name every valid value, so adding one to the code without the docs fails here.
    assert rows["algorithm.name"].type == "str"
    assert [a for a in ALGORITHMS if a not in rows["algorithm.name"].description] == []
    assert [t for t in SOURCE_TYPES if t not in rows["reward.sources[].type"].description] == []


def test_secret_keys_are_marked(rows):
    secret = {key for key, row in rows.items() if row.secret}
    expected = {"run.storage_options", "data.storage_options", "checkpoint.mirror_storage_options"}
    assert secret == expected | {"alerts.webhook_url", "alerts.headers"}


def test_help_keys_prefix_filters_and_an_unknown_prefix_is_an_error():
    assert {r.key for r in key_rows("kl")} == {f"kl.{k}" for k in KLConfig.model_fields}
    with pytest.raises(ConfigError, match="no config key under 'ppx'"):
        command_config(argparse.Namespace(markdown=False, help_keys="ppx"))


def test_rlflow_config_help_keys_prints_only_that_section():
    script = Path(sys.executable).parent / "rlflow"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "rlflow.flows.cli.main"]
    argv = command + ["config", "--help-keys", "rl"]
    result = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    keys = [line.split(":")[0] for line in result.stdout.splitlines() if line and not line.startswith(" ")]
    assert "rl.max_grad_norm" in keys and "rl.clip_ratio" in keys and "ppo.kl.target" not in keys
    assert all(key.startswith("rl.") for key in keys), keys
