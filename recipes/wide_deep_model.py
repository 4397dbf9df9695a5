"""Wide & Deep (Cheng et al., 2016) for Criteo-format data, with its tables as host embeddings.

* wide: a linear model, one learned weight per hashed categorical id (a 1-wide table) plus a
  linear layer over the 13 dense features (which also holds the global bias);
* deep: an MLP over the concatenated id embeddings (one ``embedding_size`` row per field) and the
  dense features.

The logit is their sum. Both tables are ``hetero.nn.EmbeddingLookup`` with the configured
``target``: with "CPU" they stay in host memory when the model is moved to the accelerator, the
lookups run there and only the looked-up rows cross; their row-sparse gradients go to a sparse
optimizer on the host (``table_parameters``) while the MLP trains on the accelerator with Adam.
With ``sharding="row"`` each rank holds one block of each table's rows (a parameter server).
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.nn import EmbeddingLookup
from recipes.criteo import NUM_DENSE, NUM_SPARSE


def _mlp(sizes: list[int], dropout: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class WideDeep(nn.Module):
    """Click logit of (dense ``[B, 13]`` float features, categorical ids ``[B, 26]``)."""

    def __init__(self, vocab_size: int, embedding_size: int, deep_layers: list[int],
                 target: str = "CPU", dropout: float = 0.0, sharding: str = "none",
                 cache_size: int | None = None, disk_path: str | None = None) -> None:
        super().__init__()
        if not deep_layers or any(n < 1 for n in deep_layers):
            raise ValueError(f"model.deep_layers={deep_layers}: give one or more positive widths")
        self.wide_table = EmbeddingLookup(vocab_size, 1, param_init="zeros", target=target,
                                          sharding=sharding, cache_size=cache_size,
                                          disk_path=disk_path)
        self.deep_table = EmbeddingLookup(vocab_size, embedding_size, target=target,
                                          sharding=sharding, cache_size=cache_size,
                                          disk_path=disk_path)
        self.wide_dense = nn.Linear(NUM_DENSE, 1)
        self.deep = _mlp([NUM_SPARSE * embedding_size + NUM_DENSE, *deep_layers, 1], dropout)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        wide = self.wide_table(ids).sum(dim=(1, 2)) + self.wide_dense(dense).squeeze(-1)
        deep_in = torch.cat([self.deep_table(ids).flatten(1), dense], dim=1)
        return wide + self.deep(deep_in).squeeze(-1)

    def table_parameters(self) -> list[nn.Parameter]:
        """The embedding tables and their caches' rows (row-sparse gradients: the sparse
        optimizer's share)."""
        return [p for m in self.modules() if isinstance(m, EmbeddingLookup)
                for p in m.parameters()]

    def cache_stats(self) -> dict[str, float]:
        """The deep table's cache hit rate over its last refresh window (empty without one)."""
        return self.deep_table.cache_stats()

    def dense_parameters(self) -> list[nn.Parameter]:
        """Everything else (dense gradients: Adam's share)."""
        tables = {id(p) for p in self.table_parameters()}
        return [p for p in self.parameters() if id(p) not in tables]

    def table_names(self) -> list[str]:
        """Parameter names of the tables (what DDP must leave alone)."""
        tables = {id(p) for p in self.table_parameters()}
        return [n for n, p in self.named_parameters() if id(p) in tables]
