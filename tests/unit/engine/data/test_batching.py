import torch

from rlflow.engine.data.batching import PromptResponseIds, batch_indices, bootstrap_weights, left_pad, right_pad


def test_right_pad_masks_response_by_length_even_when_eos_is_the_pad_token():
    pad = eos = 0
    rows = [PromptResponseIds([5, 6], [7, eos]), PromptResponseIds([5], [eos])]
    ids, attention, response = right_pad(rows, pad)
    assert ids.tolist() == [[5, 6, 7, 0], [5, 0, 0, 0]]
    assert attention.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # The EOS (== pad) is a loss position in both rows; the true padding is not.
    assert response.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_left_pad():
    ids, attention = left_pad([[1, 2, 3], [4]], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [9, 9, 4]] and attention.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_batches_are_a_pure_function_of_step_and_cover_each_epoch():
    n, size = 10, 4
    first_epoch = [i for step in (1, 2) for i in batch_indices(n, size, step, 0, 0)] + batch_indices(n, size, 3, 0, 0)[
        :2
    ]
    assert sorted(first_epoch) == list(range(n))  # steps 1..3 (10 items) are one permutation
    assert batch_indices(n, size, 3, 0, 0) == batch_indices(n, size, 3, 0, 0)
    assert batch_indices(n, size, 1, 0, 0) != batch_indices(n, size, 1, 1, 0)  # other seed, other order


def test_bootstrap_weights_are_each_heads_own_poisson_resample_and_a_pure_function_of_the_seed():
    weights = bootstrap_weights(4000, 4, 7, 0, 3)
    assert weights.shape == (4000, 4) and torch.equal(weights, bootstrap_weights(4000, 4, 7, 0, 3))
    assert not torch.equal(weights, bootstrap_weights(4000, 4, 8, 0, 3))  # another seed, other resamples
    assert torch.equal(weights, weights.round()) and weights.min() >= 0  # counts
    # Poisson(1): mean 1, variance 1, a share e^-1 of the items left out of each head's resample.
    assert torch.allclose(weights.mean(0), torch.ones(4), atol=0.05)
    assert torch.allclose(weights.var(0), torch.ones(4), atol=0.1)
    assert torch.allclose((weights == 0).float().mean(0), torch.full((4,), 0.3679), atol=0.03)
    assert all(not torch.equal(weights[:, 0], weights[:, h]) for h in (1, 2, 3))  # heads resample apart
    assert torch.equal(bootstrap_weights(5, 1, 7), torch.ones(5, 1))  # one head: every item once
