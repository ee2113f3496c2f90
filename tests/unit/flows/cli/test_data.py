"""`rlflow data gym`'s --config items, read as YAML values, and their errors naming the item."""

import pytest

from rlflow.engine.errors import ConfigError
from rlflow.flows.cli.data import parse_config_items


def test_items_are_read_as_yaml_values():
    items = ["max_digits=2", " flag = true", "ops=[+, -]", "name=chain_sum", "ratio=0.5"]
    assert parse_config_items(items) == {
        "max_digits": 2, "flag": True, "ops": ["+", "-"], "name": "chain_sum", "ratio": 0.5,
    }  # fmt: skip
    assert parse_config_items([]) == {}


@pytest.mark.parametrize(
    "item,message",
    [
        ("max_digits", "--config 'max_digits' must look like key=value"),
        ("=2", "--config '=2' must look like key=value"),
        ("ops=[1, 2", r"--config 'ops=\[1, 2': the value is not valid YAML; quote it"),
    ],
)
def test_a_bad_item_is_named(item, message):
    with pytest.raises(ConfigError, match=message):
        parse_config_items([item])
