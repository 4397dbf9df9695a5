"""Decoders as users write them, with names of their own (no ``blocks``, no ``tok_emb``, no
HuggingFace config): what the cluster planner must read from the captured graph
(``tests/test_cluster_planner_shapes.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Mixer(nn.Module):
    """Attention with ``kv_heads`` key/value heads (grouped-query when fewer than ``heads``)."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.wq = nn.Linear(width, width, bias=False)
        self.wkv = nn.Linear(width, 2 * kv_heads * self.dim, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q = self.wq(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = self.wkv(x).view(b, t, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class Gated(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(width, ffn, bias=False), nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Plain(nn.Module):
    """GELU MLP: ``fc2(gelu(fc1(x)))``."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, ffn), nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, ffn: int, gated: bool) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mix = Mixer(width, heads, kv_heads)
        self.ff = Gated(width, ffn) if gated else Plain(width, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.n1(x))
        return x + self.ff(self.n2(x))


class MyDecoder(nn.Module):
    """Token embedding (``vocab`` rows), optional learned positions, ``depth`` layers in a
    ``trunk``, a final norm and a head, tied to the embedding or not."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, kv_heads: int | None = None,
                 ffn: int | None = None, gated: bool = False, tied: bool = True,
                 max_len: int | None = 64) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab, width)
        self.where = nn.Embedding(max_len, width) if max_len else None
        self.trunk = nn.ModuleList(Layer(width, heads, kv_heads or heads, ffn or 4 * width,
                                         gated) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, vocab, bias=False)
        if tied:
            self.unembed.weight = self.words.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.words(ids)
        if self.where is not None:
            x = x + self.where(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.trunk:
            x = layer(x)
        return self.unembed(self.norm(x))
