"""Ulysses attention (DeepSpeed-Ulysses): trade the sequence split for a head split around the
attention, with one all-to-all before and one after.

Each rank holds ``T/c`` tokens of all ``h`` heads; the all-to-all gives it all ``T`` tokens of
``h/c`` heads, torch's own ``F.scaled_dot_product_attention`` (its fused kernel, causal or not)
runs on them, and the reverse all-to-all returns the local tokens of all heads. The gathered
chunks arrive in rank order, which in the balanced layout is not the sequence's order, so they are
put in order before the attention and back after it. The query heads must divide by the context
degree, and the key/value heads must divide by it or into it (fewer key/value heads than ranks are
repeated, as DeepSpeed does); ring attention has no such limit. The all-to-alls are the project's
differentiable ones (``parallel.collectives``), so autograd runs them backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.collectives import all_to_all
from parallel.context_parallel.layout import chunk_count, unshard_order


def _reorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    chunks = x.unflatten(-2, (len(order), x.shape[-2] // len(order)))
    return chunks[..., order, :, :].flatten(-3, -2)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup, *, causal: bool = True,
                      scale: float | None = None, balanced: bool = True) -> torch.Tensor:
    """Attention of this rank's queries over the sequence split across ``group`` (inputs and
    output ``[batch, heads, local tokens, head dim]``), computed head-parallel."""
    degree = dist.get_world_size(group)
    if k.shape[-3] % degree and degree % k.shape[-3] == 0 and q.shape[-3] % degree == 0:
        # fewer key/value heads than ranks: each rank takes a copy of its queries' group
        k, v = (t.repeat_interleave(degree // k.shape[-3], dim=-3) for t in (k, v))
    for name, t in (("query", q), ("key/value", k)):
        if t.shape[-3] % degree:
            raise ValueError(f"Ulysses attention: the {t.shape[-3]} {name} heads do not divide "
                             f"by context_degree={degree}; use ring attention "
                             f"(context_method='ring') or a degree dividing the heads")
    order = unshard_order(degree, balanced)
    back = [order.index(i) for i in range(chunk_count(degree, balanced))]

    def gather_tokens(t: torch.Tensor) -> torch.Tensor:
        return _reorder(all_to_all(t, split_dim=-3, concat_dim=-2, group=group), order)

    y = F.scaled_dot_product_attention(
        gather_tokens(q), gather_tokens(k), gather_tokens(v), is_causal=causal, scale=scale,
        enable_gqa=k.shape[-3] != q.shape[-3])
    return all_to_all(_reorder(y, back), split_dim=-2, concat_dim=-3, group=group)
