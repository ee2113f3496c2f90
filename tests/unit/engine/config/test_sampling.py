"""The sampling section and the record the samplers take."""

import pytest
from pydantic import ValidationError

from rlflow.engine.config.sampling import SamplingConfig, SamplingParams


def test_params_carry_the_section_and_greedy_keeps_only_the_token_limit():
    section = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=40)
    assert section.params() == SamplingParams(0.7, 0.9, 40)
    assert section.params(greedy=True) == SamplingParams(0.0, 1.0, 40)
    assert SamplingConfig().params() == SamplingParams()  # one set of defaults


@pytest.mark.parametrize("keys", [{"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.01}, {"max_new_tokens": 0}])
def test_a_sampled_policy_needs_a_distribution(keys):
    # temperature 0 is greedy: evaluations ask for it with eval.greedy, never the section itself,
    # since the RL stage's ratio needs the sampled distribution.
    with pytest.raises(ValidationError):
        SamplingConfig(**keys)
