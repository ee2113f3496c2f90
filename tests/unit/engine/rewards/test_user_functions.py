"""User functions named in the config: loading (errors name the key and the function), binding
kwargs, and scoring answers (floats, mappings with components, non-finite scores)."""

import math

import pytest

from rlflow.engine.config.base import FunctionRef
from rlflow.engine.errors import ConfigError
from rlflow.engine.rewards.user_functions import GoldScores, load_bound_function, load_function, score_answers


def test_load_function_returns_the_named_function():
    assert load_function("math:sqrt", "gold.fn") is math.sqrt


def test_a_missing_module_names_the_key_and_the_module():
    with pytest.raises(ConfigError, match=r"gold\.fn: cannot import module 'no_such_module_xyz'.*PYTHONPATH"):
        load_function("no_such_module_xyz:score", "gold.fn")


def test_a_missing_or_non_callable_attribute_names_the_key_and_the_function():
    with pytest.raises(ConfigError, match=r"label\.fn: module 'math' has no function 'nope'"):
        load_function("math:nope", "label.fn")
    with pytest.raises(ConfigError, match=r"label\.fn: module 'math' has no function 'pi'"):
        load_function("math:pi", "label.fn")  # math.pi exists but is a float


def test_load_bound_function_binds_the_refs_kwargs():
    fn = load_bound_function(FunctionRef(fn="helpers.reward_fns:scaled_length", kwargs={"scale": 3}), "gold.fn")
    assert fn("p", "abcd") == 12


def test_load_bound_function_without_kwargs_is_the_function_itself():
    assert load_bound_function(FunctionRef(fn="math:sqrt"), "gold.fn") is math.sqrt


def test_load_bound_function_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"gold\.fn: module 'helpers\.reward_fns' has no function 'missing'"):
        load_bound_function(FunctionRef(fn="helpers.reward_fns:missing"), "gold.fn")


def test_score_answers_passes_fields_and_collects_mapping_components():
    def fn(prompt, response, bonus=0.0):
        if response == "m":
            return {"score": 0.5, "length": len(prompt)}
        return len(response) / 10 + bonus

    result = score_answers(fn, ["a", "bbb", "cc"], ["xy", "m", "xyz"], [{}, {}, {"bonus": 0.25}])
    assert result.scores == pytest.approx([0.2, 0.5, 0.55])
    assert result.components == {"length": [3.0]}
    assert isinstance(result, GoldScores)


def test_a_non_finite_score_names_the_sample_and_its_prompt():
    def fn(prompt, response):
        return float("nan") if response == "bad" else 1.0

    with pytest.raises(ValueError, match=r"returned nan for sample 1 \(prompt 'second'\)"):
        score_answers(fn, ["first", "second"], ["ok", "bad"], [{}, {}])
