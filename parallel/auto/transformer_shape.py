"""``TransformerShape``: the sizes the cluster planner prices a decoder-only transformer by,
read from a model without running it (it may live on the meta device: a 1T-parameter model costs
no memory to plan).

Read from a HuggingFace model's ``config`` (``num_hidden_layers``, ``hidden_size``,
``num_attention_heads``, ``intermediate_size``, ``vocab_size``, and the GPT-2 names) or from a
model with a ``blocks`` ``ModuleList`` of layers, a token ``nn.Embedding`` and attention modules
holding ``n_head`` (the recipe GPT); the sequence length is the example input's second dimension.
Anything else is refused by name: give a ``TransformerShape`` directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's sizes: ``layers`` blocks of ``hidden`` width with ``heads``
    attention heads and an MLP of ``ffn`` width, over ``seq`` tokens of a ``vocab``."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0  # 0: 4 × hidden

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or \
                    (value == 0 and field.name != "ffn"):
                raise ValueError(f"TransformerShape.{field.name} must be a positive int, got "
                                 f"{value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerShape: hidden={self.hidden} must be divisible by "
                             f"heads={self.heads}")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def params(self) -> int:
        """Parameters: per layer attention (4h²) + MLP (2·h·ffn) + norms/biases, plus the
        embeddings (the head tied to the token table)."""
        h = self.hidden
        per_layer = 4 * h * h + 2 * h * self.ffn_hidden + 13 * h
        return self.layers * per_layer + (self.vocab + self.seq) * h

    def flops_per_token(self) -> float:
        """Forward + backward FLOPs per token without recompute (Megatron's 72·l·h²·(...) / s
        with the MLP width general): 3 × (2 × matmul params + attention scores)."""
        h, s = self.hidden, self.seq
        layer = 2 * (4 * h * h + 2 * h * self.ffn_hidden) + 4 * s * h  # fwd, per token
        return 3 * (self.layers * layer + 2 * h * self.vocab)


def _config_value(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def shape_of(model: nn.Module, example_inputs: tuple) -> TransformerShape:
    """The model's :class:`TransformerShape` (module docstring); ``example_inputs[0]`` is one
    sample's token ids, ``[1, seq]``."""
    if not example_inputs or not isinstance(example_inputs[0], torch.Tensor) or \
            example_inputs[0].dim() != 2:
        raise ValueError("plan_cluster: example_inputs[0] must be one sample's token ids, "
                         "shape [1, seq]")
    seq = int(example_inputs[0].shape[1])
    config = getattr(model, "config", None)
    if config is not None:
        layers = _config_value(config, "num_hidden_layers", "n_layer")
        hidden = _config_value(config, "hidden_size", "n_embd")
        heads = _config_value(config, "num_attention_heads", "n_head")
        vocab = _config_value(config, "vocab_size")
        ffn = _config_value(config, "intermediate_size", "n_inner") or 0
        if None not in (layers, hidden, heads, vocab):
            return TransformerShape(layers, hidden, heads, seq, vocab, ffn)
    blocks = getattr(model, "blocks", None)
    embedding = getattr(model, "tok_emb", None)
    heads = next((m.n_head for m in model.modules() if isinstance(getattr(m, "n_head", None),
                                                                  int)), None)
    if isinstance(blocks, nn.ModuleList) and isinstance(embedding, nn.Embedding) and heads:
        mlp = next((m for m in blocks[0].modules() if isinstance(m, nn.Linear)
                    and m.in_features == embedding.embedding_dim
                    and m.out_features not in (embedding.embedding_dim,
                                               3 * embedding.embedding_dim)), None)
        return TransformerShape(len(blocks), embedding.embedding_dim, heads, seq,
                                embedding.num_embeddings, mlp.out_features if mlp else 0)
    raise ValueError(f"plan_cluster prices decoder-only transformers and cannot read the sizes "
                     f"of {type(model).__name__} (no HuggingFace config, no blocks/tok_emb); "
                     f"pass shape=TransformerShape(layers=..., hidden=..., heads=..., seq=..., "
                     f"vocab=...)")
