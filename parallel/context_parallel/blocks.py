"""Attention of one query block against one key/value block, with its log-sum-exp, and the
gradient of that block: the two kernels ring attention merges block by block.

torch's ``F.scaled_dot_product_attention`` returns neither the log-sum-exp a merge needs nor
takes the final one its backward needs; its fused kernels do, privately and per device. Where
``foundation.compat`` has the fused kernel for the inputs (the host's flash kernel in
fp32/bf16/fp16, CUDA's FlashAttention-2 in bf16/fp16) a block runs on it, holding no score
matrix; elsewhere (an NPU, fp32 on a GPU, a kernel that failed on its first use) it runs here in
plain tensor operations (in fp32, or wider inputs' own dtype), holding one block's scores:
``T/c`` queries against ``T/c`` keys (a quarter of that in the balanced layout's halves).

Grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q`` (a divisor); they are
repeated for the product and their gradients summed back, so the ring passes the small tensors.
"""

from __future__ import annotations

import torch

from foundation import compat


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a block is computed and merged in: fp32, or the inputs' own when wider."""
    return torch.promote_types(dtype, torch.float32)


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.to(acc_dtype(t.dtype))


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    heads = grad.shape[-3]
    if heads == kv_heads:
        return grad
    return grad.unflatten(-3, (kv_heads, heads // kv_heads)).sum(-3)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:  # the diagonal block: query i sees keys 0..i of the same chunk
        tq, tk = scores.shape[-2:]
        upper = torch.ones(tq, tk, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    return scores


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q kᵀ · scale) v`` for one block pair (``acc_dtype``), and its row log-sum-exp."""
    if compat.has_fused_attention_block(q):
        heads = q.shape[-3]
        fused = compat.fused_attention_block(q, _expand(k, heads), _expand(v, heads), causal,
                                             scale)
        if fused is not None:  # else the kernel failed on its first use (warned): plain
            return _acc(fused[0]), fused[1].to(acc_dtype(q.dtype))
    q, k, v = _acc(q), _expand(_acc(k), q.shape[-3]), _expand(_acc(v), q.shape[-3])
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, delta: torch.Tensor, lse: torch.Tensor, scale: float,
                    causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of ``dq``, ``dk``, ``dv`` (``acc_dtype``), given the merged output's
    ``lse`` and ``delta = rowsum(dout * out)``: FlashAttention's backward, block by block
    (``out``: the merged output of these rows, which the fused kernel takes instead)."""
    kv_heads = k.shape[-3]
    if compat.has_fused_attention_block(q):
        heads = q.shape[-3]
        fused = compat.fused_attention_block_backward(
            dout, q, _expand(k, heads), _expand(v, heads), out, lse.float(), causal, scale)
        if fused is not None:
            dq, dk, dv = fused
            return _acc(dq), _fold(_acc(dk), kv_heads), _fold(_acc(dv), kv_heads)
    q, dout = _acc(q), _acc(dout)
    k, v = _expand(_acc(k), q.shape[-3]), _expand(_acc(v), q.shape[-3])
    probs = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    dv = probs.transpose(-2, -1) @ dout
    dscores = probs * (dout @ v.transpose(-2, -1) - delta.unsqueeze(-1)) * scale
    return dscores @ k, _fold(dscores.transpose(-2, -1) @ q, kv_heads), _fold(dv, kv_heads)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial results over disjoint keys into one."""
    if out is None or lse is None:
        return block_out, block_lse
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new).unsqueeze(-1)
            + block_out * torch.exp(block_lse - new).unsqueeze(-1)), new
