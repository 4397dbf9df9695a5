"""``parallel.nn.MoE``: a drop-in FFN of ``num_experts`` experts, ``top_k`` per token.

Forward: route (:mod:`.router`), sort the kept token-choices by expert, run each expert on its
tokens (:mod:`.experts`), scale by the routing weights and add each token's results back in its
place. ``moe.aux_loss`` holds the load-balancing loss of the last forward (add it to the
training loss), ``moe.dropped`` how many token-choices exceeded capacity, ``moe.load`` the
token-choices each expert was sent. ``dropless=True`` drops nothing (no capacity).

This is the single-device layer; expert parallel (experts sharded over the mesh's ``ep`` ranks,
tokens exchanged by all-to-all) builds on the same router and stacked experts.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.nn.experts import GroupedExperts
from parallel.nn.router import TopKRouter, capacity

ROUTERS = ("softmax_topk",)


def _check(d_model: int, d_ff: int, num_experts: int, top_k: int, capacity_factor: float,
           aux_loss_factor: float, router: str) -> None:
    for name, value in (("d_model", d_model), ("d_ff", d_ff), ("num_experts", num_experts),
                        ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"MoE: top_k={top_k} exceeds num_experts={num_experts}; a token "
                         f"cannot pick more experts than there are")
    if not capacity_factor > 0:
        raise ValueError(f"MoE: capacity_factor must be > 0, got {capacity_factor!r} (use "
                         f"dropless=True for no capacity limit)")
    if not aux_loss_factor >= 0:
        raise ValueError(f"MoE: aux_loss_factor must be >= 0, got {aux_loss_factor!r}")
    if router not in ROUTERS:
        raise ValueError(f"MoE: router {router!r} is not one of {ROUTERS}")


class MoE(nn.Module):
    """Mixture of experts in place of an FFN (see the module docstring).

    Args:
        d_model, d_ff: the FFN's sizes, per expert.
        num_experts, top_k: experts, and how many each token uses.
        capacity_factor: capacity = ceil(top_k · tokens · factor / experts) per expert.
        aux_loss_factor: scale of the load-balancing loss in ``aux_loss``.
        dropless: no capacity; every choice is computed.
        router: ``"softmax_topk"``.
        balance_bias: aux-loss-free balancing; call :meth:`update_balance` after each step.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, *, top_k: int = 2,
                 capacity_factor: float = 1.1, aux_loss_factor: float = 0.05,
                 dropless: bool = False, router: str = "softmax_topk",
                 balance_bias: bool = False) -> None:
        super().__init__()
        _check(d_model, d_ff, num_experts, top_k, capacity_factor, aux_loss_factor, router)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.dropless = capacity_factor, dropless
        self.router = TopKRouter(d_model, num_experts, top_k, aux_loss_factor, balance_bias)
        self.experts = GroupedExperts(d_model, d_ff, num_experts)
        self.aux_loss = torch.zeros(())
        self.dropped = 0
        self.load = torch.zeros(num_experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n = tokens.shape[0]
        cap = None if self.dropless else capacity(n, self.top_k, self.num_experts,
                                                  self.capacity_factor)
        route = self.router(tokens, cap)
        self.aux_loss, self.load = route.aux_loss, route.load
        self.dropped = int((~route.kept).sum())
        token_of = torch.arange(n, device=x.device).unsqueeze(1).expand_as(route.experts)
        kept = route.kept.reshape(-1)
        expert = route.experts.reshape(-1)[kept]
        order = torch.argsort(expert, stable=True)  # group by expert, token order within
        token = token_of.reshape(-1)[kept][order]
        weight = route.weights.reshape(-1)[kept][order]
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        out = self.experts(tokens[token], counts) * weight.unsqueeze(1)
        combined = torch.zeros_like(tokens).index_add(0, token, out)
        return combined.reshape(shape)

    def update_balance(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing: move the routing bias by ``rate`` from the last forward's
        load (a no-op without ``balance_bias``)."""
        self.router.update_bias(self.load, rate)
