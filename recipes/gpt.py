"""A small GPT: decoder-only transformer with pre-LayerNorm blocks and a weight-tied output head.

Sized for CPU recipes and tests (the default config has ~1.8 M parameters). Attention is
``F.scaled_dot_product_attention(is_causal=True)``, so each backend picks its fused kernel. The
output head ``lm_head`` shares the token embedding's weight (as HuggingFace's GPT-2 does), so a
pipeline can hold the embedding in its first stage and the head in its last.

Built under ``torch.device("meta")`` (``model.init_device=meta``), its values come from
``init_parameter`` one tensor at a time, after ``parallel.parallelize`` has split and sharded it.

With ``moe`` options (``model=gpt_moe``) every ``moe_every``-th block's MLP is a
``parallel.nn.MoE`` and the loss adds each MoE layer's load-balancing loss.

Pipeline stages are this model with other stages' parts removed (``parallel.pipeline``): the
forward skips a missing embedding (its input is then the hidden state) and returns the hidden
state when the head is missing; ``blocks`` runs whichever blocks this stage holds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallel.nn import MoE
from parallel.semi_auto.sharded_rows import foldable


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (also a pipeline's ``loss_fn(output, target)``), computed in
    fp32 from upcast logits whatever their dtype (16-bit weights, autocast), as Megatron-LM and
    torchtitan do: a 16-bit loss would be rounded to a few significant bits."""
    if foldable(logits):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    # a sequence-split DTensor torch 2.11 cannot fold: the classes moved to dim 1 instead
    return F.cross_entropy(logits.transpose(1, 2).float(), targets)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and earlier positions only."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_head={n_head}")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float,
                 moe: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = (MoE(d_model, 4 * d_model, **moe) if moe else nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layer`` blocks, final LayerNorm, tied head.

    ``moe``: ``parallel.nn.MoE`` keyword arguments (``num_experts``, ``top_k``, ...) for the MLP
    of every ``moe_every``-th block (the last of each group of ``moe_every``); None: all dense.
    """

    def __init__(
        self, vocab_size: int, d_model: int = 192, n_layer: int = 4, n_head: int = 6,
        block_size: int = 64, dropout: float = 0.0, moe: Mapping[str, Any] | None = None,
        moe_every: int = 1,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.n_layer = n_layer
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_head, dropout, moe if (i + 1) % moe_every == 0 else None)
            for i in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled down by
        sqrt(2 * n_layer) so the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, MoE):  # stacked experts: each expert like a dense MLP
                nn.init.normal_(module.experts.w1, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight", "mlp.experts.w2")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` (host storage) with parameter or buffer ``name``'s initial value by
        ``_init_weights``' rules, one tensor at a time: what deferred initialization
        (``parallel.materialize``, a meta model given to ``parallel.parallelize``) calls, with the
        generator already seeded for this name. LayerNorms start at ones and zeros, as built."""
        path, _, leaf = name.rpartition(".")
        owner = self.get_submodule(path)
        if name.endswith(("attn.proj.weight", "mlp.2.weight", "mlp.experts.w2")):
            nn.init.normal_(tensor, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layer))
        elif (leaf == "weight" and isinstance(owner, (nn.Linear, nn.Embedding))) or (
                name.endswith("mlp.experts.w1")):
            nn.init.normal_(tensor, mean=0.0, std=0.02)
        elif isinstance(owner, nn.LayerNorm):
            nn.init.ones_(tensor) if leaf == "weight" else nn.init.zeros_(tensor)
        elif leaf == "bias":  # Linear biases, the MoE router's balancing bias
            nn.init.zeros_(tensor)
        else:
            raise ValueError(f"GPT.init_parameter: no rule for '{name}'")

    def num_params(self) -> int:
        """Trainable parameter count (the tied head adds none)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None] | torch.Tensor:
        """Logits ``[batch, time, vocab]`` and, given targets, the mean cross-entropy loss.

        ``position_ids`` (``[time]`` or ``[batch, time]``): the tokens' places in the sequence,
        ``0..time-1`` when not given; context parallel gives each rank's share of them.
        As a pipeline stage without the embedding, ``idx`` is the previous stage's hidden state;
        without the head, the hidden state is returned."""
        x = idx
        if self.tok_emb is not None:
            t = idx.shape[1]
            # a Proxy while torch.fx traces the forward (multi_copy), where the check cannot run
            if position_ids is None and not isinstance(t, torch.fx.Proxy) and \
                    t > self.block_size:
                raise ValueError(f"sequence length {t} exceeds model.block_size={self.block_size}")
            if position_ids is None:
                pos = torch.arange(t, device=idx.device)
            elif position_ids.dim() == 2 and position_ids.shape[0] == 1:
                pos = position_ids[0]  # one row for all, as the [time] form (a strategy lays
            else:  # out pos_emb's input 1-D)
                pos = position_ids
            x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = lm_loss(logits, targets)
            for block in self.blocks:  # each MoE layer's balancing loss of this forward
                if isinstance(block.mlp, MoE):
                    loss = loss + block.mlp.aux_loss
        return logits, loss
