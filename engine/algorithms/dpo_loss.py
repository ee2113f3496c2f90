"""The DPO loss (Rafailov et al. 2023) and its implicit rewards, as pure tensor functions.

DPO reads a policy as a reward model: r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)), up to a
term that depends on the prompt only and cancels within a pair. The Bradley-Terry likelihood of
the preference labels under that reward is the loss. With label smoothing eps (conservative DPO,
"cDPO"), each label is taken to be flipped with probability eps.

Sequence log-probs are SUMS over the response tokens (nats), never means: the implicit reward is
the log-ratio of whole-sequence probabilities.

DPO only fixes the chosen-minus-rejected margin, and on its own often lowers both log-probs, moving
mass to answers in neither set (for small models: invalid tokens). RPO (Pang et al. 2024,
"Iterative Reasoning Preference Optimization") adds the chosen answer's per-token NLL with weight
alpha, which keeps the chosen answers likely; online multi-round DPO needs it most.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss and the implicit rewards of both answers.

    All inputs: [B] float, log pi(y|x) summed over the response tokens (nats); the reference's are
    constants (no gradient flows into them). beta > 0 scales the log-ratios (small beta: the policy
    may move far from the reference); 0 <= label_smoothing < 0.5 is the assumed label-flip rate.

    h = (pi_c - pi_r) - (ref_c - ref_r)
    loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)     [B], nats

    Returns (loss [B], chosen_rewards [B], rejected_rewards [B]); rewards = beta * (pi - ref),
    detached (they are for logging and accuracy, not for the gradient). The caller averages the
    loss over pairs. Equal policy and reference give h = 0: loss log 2 and zero rewards.
    """
    h = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    logits = beta * h.float()  # float32: logsigmoid of bf16 margins rounds visibly
    loss = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    chosen_rewards = beta * (policy_chosen_logps.float() - ref_chosen_logps.float()).detach()
    rejected_rewards = beta * (policy_rejected_logps.float() - ref_rejected_logps.float()).detach()
    return loss, chosen_rewards, rejected_rewards


def chosen_nll(policy_chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Per-pair negative log-likelihood of the chosen answer per token: [B] nats/token.

    policy_chosen_logps: [B] summed response log-probs (nats); chosen_tokens: [B] their token
    counts (>= 1). The mean over tokens keeps long and short answers on one scale, as in RPO."""
    return -policy_chosen_logps.float() / chosen_tokens.float().clamp(min=1)
