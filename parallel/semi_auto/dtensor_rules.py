"""Sharding rules DTensor lacks on CPU, added through its public ``register_sharding`` hook.

DTensor knows how to shard the GPU flash and efficient attention kernels, but not the CPU one
(``aten._scaled_dot_product_flash_attention_for_cpu``), so any model that calls
``F.scaled_dot_product_attention`` on CPU DTensors fails with "does not have a sharding strategy
registered". Attention is independent per batch element and per head, so the rule mirrors
DTensor's GPU one: everything replicated, everything sharded on batch (dim 0), or everything
sharded on heads (dim 1; ``logsumexp`` is ``[batch, heads, time]``). Registered once, at import.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

aten = torch.ops.aten


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _cpu_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                         scale=None):
    # outputs: (output, logsumexp); inputs: query, key, value, dropout_p, is_causal
    return [([p, p], [p, p, p, None, None]) for p in (Replicate(), Shard(0), Shard(1))]


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _cpu_flash_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                                  is_causal, *, attn_mask=None, scale=None):
    # outputs: grad q, k, v; inputs: grad_out, q, k, v, out, logsumexp, dropout_p, is_causal
    return [([p] * 3, [p] * 6 + [None, None]) for p in (Replicate(), Shard(0), Shard(1))]
