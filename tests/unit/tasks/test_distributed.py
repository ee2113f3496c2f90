"""The distributed launch's pure part: the secret strings masked in the ranks' log lines."""

import json

from rlflow.tasks.distributed import secret_values


def test_every_secret_and_the_json_the_ranks_receive_are_masked_longest_first():
    tree = {"run": {"storage_options": {"key": "AKIA-1234", "nested": ["s3cr3t-token"]}}}
    values = secret_values(tree)
    assert set(values) == {"AKIA-1234", "s3cr3t-token", json.dumps(tree)}
    assert values == sorted(values, key=len, reverse=True)  # a longer secret is masked before its parts


def test_no_secrets_mask_nothing():
    assert secret_values({}) == []
