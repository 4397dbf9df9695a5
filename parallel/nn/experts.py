"""The experts of an MoE layer as stacked weights: ``w1 [E, d_model, d_ff]`` and
``w2 [E, d_ff, d_model]`` (one tensor each, so expert parallel can shard them as ``Shard(0)``
DTensors and host placement can move them as one module)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class GroupedExperts(nn.Module):
    """``E`` two-layer GELU MLPs applied to tokens already grouped by expert."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        for w in (self.w1, self.w2):  # nn.Linear's default, per expert
            bound = 1 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` sorted by expert, ``counts[e]`` of them for expert ``e``."""
        outs = [F.gelu(chunk @ self.w1[e]) @ self.w2[e]
                for e, chunk in enumerate(tokens.split(counts)) if counts[e]]
        return torch.cat(outs) if outs else tokens.new_zeros(0, self.w2.shape[-1])
