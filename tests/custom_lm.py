"""A user's own model for ``model=custom model._target_=custom_lm.TinyLM``
(tests/test_hf_recipe.py): built from ``model.kwargs`` plus the tokenizer's ``vocab_size``;
``forward(idx, targets)`` returns what ``returns`` says (docs/your-model.md allows each)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    """Embedding, ``n_layer`` residual MLP blocks over a causal running mean, a head."""

    def __init__(self, vocab_size: int, d_model: int = 32, n_layer: int = 2,
                 returns: str = "loss") -> None:
        super().__init__()
        if returns not in ("loss", "logits", "both"):
            raise ValueError(f"returns must be loss, logits or both, got {returns!r}")
        self.returns = returns
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 2 * d_model), nn.GELU(),
                          nn.Linear(2 * d_model, d_model)) for _ in range(n_layer))
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(idx)
        steps = torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=x.dtype)
        x = x + x.cumsum(1) / steps[:, None]  # what came before, causally
        for layer in self.layers:
            x = x + layer(x)
        logits = self.head(x)
        if self.returns == "logits" or targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss if self.returns == "loss" else (logits, loss)
