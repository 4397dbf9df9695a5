"""What splitting the sequence over ``context`` ranks costs and saves in the cluster planner.

Context parallel (``parallel.context_parallel``) gives each of ``c`` ranks ``s/c`` of every
micro-batch's tokens in balanced chunks, so a rank's layer FLOPs, activations, logits and tensor
and pipeline messages all fall to ``1/c`` (the planner prices them on the rank's tokens). What it
adds is ring attention's exchange, per layer and micro-batch: the key/value block passes ``c-1``
times forward (bf16), again ``c-1`` times backward with ``c`` passes of its fp32 gradient
accumulator, and once more forward under full recompute; each pass runs behind one block of
attention, so only what exceeds the layer's attention compute is exposed. The context ranks are
replicas for the gradient reduction and the optimizer's shards (``dp × cp`` ranks).
"""

from __future__ import annotations

from typing import Any

from parallel.auto.cluster import ClusterSpec
from parallel.auto.transformer_shape import TransformerShape

ACTIVATION_BYTES = 2  # bf16 keys and values
GRADIENT_BYTES = 4  # the fp32 accumulators that follow them backward


def ring_bytes(shape: TransformerShape, lay: Any) -> float:
    """Bytes one rank sends per layer and micro-batch for ring attention (module docstring)."""
    c = lay.context
    if c == 1:
        return 0.0
    tokens = lay.micro_batch_size * shape.seq / c
    kv_width = shape.hidden * (shape.kv_heads or shape.heads) // shape.heads / lay.tensor
    block = 2 * tokens * kv_width  # k and v
    forwards = 2 if lay.recompute == "full" else 1
    return block * ((c - 1) * ACTIVATION_BYTES * (forwards + 1) + c * GRADIENT_BYTES)


def exposed_ring(shape: TransformerShape, lay: Any, cluster: ClusterSpec,
                 attention_seconds: float) -> float:
    """Seconds of one layer's ring exchange per micro-batch that its attention compute
    (``attention_seconds``, forward and backward) does not hide."""
    if lay.context == 1:
        return 0.0
    across = lay.tensor * lay.context > cluster.devices_per_node
    passes = (lay.context - 1) * (3 if lay.recompute == "full" else 2) + lay.context
    moved = cluster.send(ring_bytes(shape, lay) / passes, across) * passes
    return max(0.0, moved - attention_seconds)
