"""``TransformerShape``: the sizes the cluster planner prices a decoder-only transformer by,
read from a model without running it (it may live on the meta device: a 1T-parameter model costs
no memory to plan).

:func:`shape_of` reads them from the model's captured graph (``parallel.auto.decoder_shape``),
whatever its modules are called; the sequence length is the example input's second dimension.
A model whose graph lacks a part is refused naming the part: give a ``TransformerShape`` directly.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's sizes: ``layers`` blocks of ``hidden`` width with ``heads``
    attention heads and an MLP of ``ffn`` width, over ``seq`` tokens of a ``vocab``. A mixture
    of experts: ``moe_layers`` of the layers (0: all) have ``experts`` MLPs of that width in
    place of one, each token routed to ``top_k`` of them."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0  # 0: 4 × hidden
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as heads
    gated: bool = False  # a gated MLP (SwiGLU: gate, up and down projections) instead of two
    tied: bool = True  # the output head shares the token embedding's table
    experts: int = 0  # MLPs of an MoE layer (0: no MoE layers)
    top_k: int = 0  # experts each token uses (with experts)
    moe_layers: int = 0  # layers whose MLP is the experts (0 with experts: every layer)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("gated", "tied"):
                if not isinstance(value, bool):
                    raise ValueError(f"TransformerShape.{field.name} must be a bool, got "
                                     f"{value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 0 or \
                    (value == 0 and field.name not in ("ffn", "kv_heads", "experts", "top_k",
                                                       "moe_layers")):
                raise ValueError(f"TransformerShape.{field.name} must be a positive int, got "
                                 f"{value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerShape: hidden={self.hidden} must be divisible by "
                             f"heads={self.heads}")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"TransformerShape: kv_heads={self.kv_heads} must divide "
                             f"heads={self.heads}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"TransformerShape: top_k={self.top_k} must be 1 to experts="
                             f"{self.experts} (the experts each token uses)")
        if not self.experts and (self.top_k or self.moe_layers):
            raise ValueError(f"TransformerShape: top_k={self.top_k} and moe_layers="
                             f"{self.moe_layers} describe MoE layers; give experts= too")
        if self.moe_layers > self.layers:
            raise ValueError(f"TransformerShape: moe_layers={self.moe_layers} exceeds layers="
                             f"{self.layers}")

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def moe_count(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return (self.moe_layers or self.layers) if self.experts else 0

    @property
    def attention_params(self) -> int:
        """One layer's attention matrices: the query and output projections (2h²), the key and
        value projections (2h² with every head, less with grouped queries)."""
        h = self.hidden
        return 2 * h * h + 2 * h * (h * (self.kv_heads or self.heads) // self.heads)

    @property
    def mlp_params(self) -> int:
        """One MLP's matrices (2·h·ffn, 3·h·ffn gated): a dense layer's, or one expert's."""
        return (3 if self.gated else 2) * self.hidden * self.ffn_hidden

    def _mlps(self, of_moe_layer: int) -> float:
        """MLPs a layer has, averaged over the layers: one in a dense layer,
        ``of_moe_layer`` in an MoE layer."""
        return 1 + (of_moe_layer - 1) * self.moe_count / self.layers

    def _per_layer(self, mlps_of_moe_layer: int) -> float:
        """A layer's matrices, MoE layers (each ``mlps_of_moe_layer`` MLPs and a router)
        averaged in: an exact int for a dense model."""
        if not self.experts:
            return self.attention_params + self.mlp_params
        router = self.moe_count * self.hidden * self.experts / self.layers
        return self.attention_params + self._mlps(mlps_of_moe_layer) * self.mlp_params + router

    @property
    def matmul_params(self) -> float:
        """The matrix parameters one token runs through in a layer (its FLOPs are twice these):
        the attention's and an MLP's; with experts, ``top_k`` MLPs and the router in the MoE
        layers, averaged over the layers."""
        return self._per_layer(self.top_k)

    @property
    def mlps_per_token(self) -> float:
        """The MLPs a token runs through in a layer, averaged over the layers (1 when dense)."""
        return self._mlps(self.top_k)

    @property
    def expert_params(self) -> int:
        """Every expert's matrices, all MoE layers (what expert parallel shards)."""
        return self.moe_count * self.experts * self.mlp_params

    @property
    def embedding_params(self) -> int:
        """The token table (twice when the head has its own), positions."""
        return ((1 if self.tied else 2) * self.vocab + self.seq) * self.hidden

    @property
    def layer_params(self) -> float:
        """One layer's parameters (the MoE layers' every expert averaged in): its matrices,
        norms and biases."""
        return self._per_layer(self.experts) + 13 * self.hidden

    def stage_layers(self, pipeline: int) -> int:
        """The layers of the fullest of ``pipeline`` stages (an uneven split gives some stages
        one more: BLOOM's 70 layers on 12 stages)."""
        return -(-self.layers // pipeline)

    @property
    def params(self) -> float:
        """Parameters: the layers (every expert) and the embeddings."""
        return self.layers * self.layer_params + self.embedding_params

    def flops_per_token(self) -> float:
        """Forward + backward FLOPs per token without recompute (Megatron's 72·l·h²·(...) / s
        with the MLP and key/value widths general): 3 × (2 × matmul params + attention
        scores)."""
        h, s = self.hidden, self.seq
        layer = 2 * self.matmul_params + 4 * s * h  # fwd, per token
        return 3 * (self.layers * layer + 2 * h * self.vocab)


def shape_of(model: nn.Module, example_inputs: tuple) -> TransformerShape:
    """The model's :class:`TransformerShape`, read from its captured graph (module docstring);
    ``example_inputs[0]`` is one sample's token ids, ``[1, seq]``."""
    if not example_inputs or not isinstance(example_inputs[0], torch.Tensor) or \
            example_inputs[0].dim() != 2:
        raise ValueError("plan_cluster: example_inputs[0] must be one sample's token ids, "
                         "shape [1, seq]")
    from parallel.auto.decoder_shape import read_decoder

    return read_decoder(model, example_inputs)
