"""Small models for the placement tests: each exercises one shape of graph."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import hetero


class MLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, 4 * d)
        self.fc3 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class Branchy(nn.Module):
    """Residual + two parallel branches that meet again (the concurrency shape)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.left = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.right = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.norm(h + self.left(h) * self.right(h))


class OpTagged(nn.Module):
    """``set_device`` on an op: the matmul runs on the host, the rest on the device."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.out = nn.Linear(d, d)
        self.host_matmul = hetero.set_device(torch.matmul, "cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.host_matmul(x, self.w)))


class ScopeTagged(nn.Module):
    """``device_scope`` on a region of forward."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with hetero.device_scope("cpu"):
            h = torch.softmax(h, dim=-1) * 3.0 + h
        return self.b(h)


@dataclasses.dataclass
class LMOutput:
    """A HuggingFace-style output dataclass (registered with pytree, as HF does for its own)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


pytree.register_dataclass(LMOutput)


class KwargsLM(nn.Module):
    """HuggingFace-style: keyword arguments in, a dataclass out, tied input/output embedding."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> LMOutput:
        h = self.body(self.embed(input_ids))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.lm_head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return LMOutput(loss=loss, logits=logits)


class BigEmbeddingModel(nn.Module):
    """A large, compute-light table in front of a small MLP: the auto-placement textbook case."""

    def __init__(self, vocab: int = 20_000, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.table = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids).mean(dim=1)).squeeze(-1)
