"""Top-k routing for a mixture of experts: scores, choices, load-balancing loss, capacity.

The router is a bias-free linear map to one logit per expert, softmaxed over the experts
(``softmax_topk``). Each token picks its ``top_k`` highest-scoring experts; with ``top_k > 1``
the chosen scores are renormalised to sum to 1 (GShard), with one expert the score itself scales
the output (Switch). Two ways to keep experts evenly loaded:

* the auxiliary loss of GShard / Switch: ``E · Σ_e f_e · P_e`` where ``f_e`` is the fraction of
  the token-choices that went to expert ``e`` and ``P_e`` the mean probability the router gave
  it, times ``aux_loss_factor`` — added to the training loss by the user (``moe.aux_loss``);
* aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores *for choosing
  only* (the weights stay the unbiased scores), nudged after each training step by
  ``bias_update_rate`` towards the under-loaded experts.

Capacity (``capacity_factor``): an expert takes at most ``ceil(k · tokens · factor / experts)``
token-choices per batch, first choices before second ones and earlier tokens first within a
rank; the rest are dropped (their share of the output is zero, so the residual carries the
token) and counted.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Token-choices one expert takes per batch: ``ceil(k · tokens · factor / experts)``."""
    return math.ceil(top_k * tokens * factor / experts)


def keep_within_capacity(experts: torch.Tensor, num_experts: int, cap: int,
                         ahead: torch.Tensor | None = None) -> torch.Tensor:
    """``[tokens, k]`` mask of the choices each expert accepts: first choices of all tokens in
    token order, then second choices, ... until the expert has ``cap``. ``ahead[j, e]`` counts
    the choices queued at expert ``e`` before this batch's ``j``-th choices (other ranks' and
    earlier choices; by default just this batch's earlier choices)."""
    onehot = F.one_hot(experts, num_experts)  # [tokens, k, E]
    if ahead is None:
        per_choice = onehot.sum(0)  # [k, E]
        ahead = per_choice.cumsum(0) - per_choice
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # within this batch's j-th choices
    position = position + ahead.gather(1, experts.t()).t()
    return position < cap


class TopKRouter(nn.Module):
    """Scores tokens over ``num_experts`` and picks ``top_k`` (see the module docstring)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, aux_loss_factor: float,
                 balance_bias: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_factor = aux_loss_factor
        # aux-loss-free balancing: moved by update_bias(), never by gradients
        self.register_buffer("bias", torch.zeros(num_experts) if balance_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs [tokens, E], experts [tokens, k], weights [tokens, k])``."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        choose = probs if self.bias is None else probs + self.bias
        experts = choose.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, experts, weights.to(x.dtype)

    def aux_loss(self, load: torch.Tensor, prob_sum: torch.Tensor, tokens: int) -> torch.Tensor:
        """The balancing loss from the batch's load per expert and summed probabilities."""
        fraction = load.float() / max(tokens * self.top_k, 1)
        mean_prob = prob_sum / max(tokens, 1)
        return self.num_experts * (fraction * mean_prob).sum() * self.aux_loss_factor

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower that of over-loaded ones."""
        if self.bias is not None:
            self.bias += rate * torch.sign(load.float().mean() - load.float())
