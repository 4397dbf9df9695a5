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

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Routing:
    """Where each token goes: ``experts``/``weights`` are ``[tokens, k]``; ``kept`` marks the
    choices within capacity; ``aux_loss`` is already scaled by ``aux_loss_factor``."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    aux_loss: torch.Tensor
    load: torch.Tensor  # token-choices per expert before dropping


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Token-choices one expert takes per batch: ``ceil(k · tokens · factor / experts)``."""
    return math.ceil(top_k * tokens * factor / experts)


def keep_within_capacity(experts: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """``[tokens, k]`` mask of the choices each expert accepts: first choices of all tokens in
    token order, then second choices, ... until the expert has ``cap``."""
    order = experts.t().reshape(-1)  # choice-major: all first choices, then all second ones
    onehot = F.one_hot(order, num_experts)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # rank of this choice at its expert
    return (position < cap).reshape(experts.shape[1], experts.shape[0]).t()


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

    def forward(self, x: torch.Tensor, cap: int | None) -> Routing:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        choose = probs if self.bias is None else probs + self.bias
        experts = choose.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        load = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        kept = (torch.ones_like(experts, dtype=torch.bool) if cap is None
                else keep_within_capacity(experts, self.num_experts, cap))
        fraction = load.float() / max(experts.numel(), 1)
        aux = self.num_experts * (fraction * probs.mean(0)).sum() * self.aux_loss_factor
        return Routing(experts, weights.to(x.dtype), kept, aux, load)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower that of over-loaded ones."""
        if self.bias is not None:
            self.bias += rate * torch.sign(load.float().mean() - load.float())
