"""``ContextParallel``: run a model on this rank's share of the sequence, its attention over the
whole sequence.

A call ``model(idx, targets, ...)`` with a ``T``-token sequence becomes, on rank ``r`` of the
``c`` context-parallel ranks:

* every tensor argument whose dimension ``seq_dim`` has ``T`` entries (token ids, targets, a
  given ``position_ids``) is cut to the rank's chunks (``layout``: balanced head-tail chunks by
  default), so the model's embeddings, MLPs, norms and loss run on ``T/c`` tokens;
* the model is given the global positions of those tokens as ``position_ids=`` (learned
  position embeddings and rotary embeddings read them; HuggingFace's decoders and the recipe GPT
  take the keyword), unless the caller passed its own;
* each ``F.scaled_dot_product_attention`` call inside the forward becomes ring attention (or
  Ulysses), found by a ``TorchFunctionMode`` around the forward as torch's own
  ``context_parallel`` finds it, so no attention module is rewritten.

The outputs are the local tokens' (logits ``[b, T/c, V]``, the mean loss over the local tokens).
Every rank holds the same number of tokens, so the mean of the ranks' losses is the sequence's
loss, and the gradient of the whole is the average of the ranks' gradients: the ranks are
replicas for the gradient reduction (``parallel.parallelize`` puts them in data parallel's
group, as torchtitan folds its ``cp`` dimension into FSDP's).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

from foundation.model_view import ModelView
from parallel.context_parallel.layout import check_length, positions, shard_sequence
from parallel.context_parallel.ring import ring_attention
from parallel.context_parallel.ulysses import ulysses_attention
from parallel.semi_auto.apply import semi_auto_state

METHODS = {"ring": ring_attention, "ulysses": ulysses_attention}
_ACTIVE = threading.local()


def split_attention() -> TorchFunctionMode | None:
    """The split-sequence attention mode this thread's forward runs under, or None: activation
    recompute captures it and enters it again when backward re-runs the forward (outside
    ``ContextParallel.forward``), so the recomputed attention is the split one too."""
    return getattr(_ACTIVE, "mode", None)


class _SplitAttention(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` calls to the context-parallel attention."""

    def __init__(self, group: dist.ProcessGroup, method: str, balanced: bool) -> None:
        super().__init__()
        self.group, self.attend, self.balanced = group, METHODS[method], balanced
        self._outer: list[TorchFunctionMode | None] = []
        self.calls = 0  # attention calls split so far

    def __enter__(self) -> _SplitAttention:
        self._outer.append(split_attention())
        _ACTIVE.mode = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.mode = self._outer.pop()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError("context parallel: scaled_dot_product_attention was called with an "
                             "attn_mask; a split sequence takes is_causal=True or no mask (a "
                             "padding mask would need its own split: pack sequences instead)")
        if dropout_p:
            raise ValueError(f"context parallel: attention dropout ({dropout_p}) is not "
                             f"supported on a split sequence; set the model's attention dropout "
                             f"to 0")
        if key.shape[-3] != query.shape[-3] and not enable_gqa:
            raise ValueError(f"context parallel: {query.shape[-3]} query heads against "
                             f"{key.shape[-3]} key heads need enable_gqa=True")
        self.calls += 1
        if isinstance(query, DTensor):
            return self._on_shards(query, key, value, causal=is_causal, scale=scale)
        return self.attend(query, key, value, self.group, causal=is_causal, scale=scale,
                           balanced=self.balanced)

    def _on_shards(self, query: DTensor, key: Any, value: Any, **options: Any) -> DTensor:
        """Attention on DTensors (a model sharded by strategies): each rank's heads or batch
        rows attend over the whole sequence through its local shards, the result laid out as
        ``query``. The context ranks are outside the strategies' mesh (``parallel.semi_auto.
        mesh.device_mesh``), so a split of the sequence or head size on it is refused."""
        where, seq = tuple(query.placements), query.ndim - 2
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, DTensor) or t.device_mesh != query.device_mesh or \
                    tuple(t.placements) != where:
                raise ValueError(f"context parallel: scaled_dot_product_attention's {name} is "
                                 f"not laid out as its query ({where}); give q, k and v one "
                                 f"layout")
        for p in where:
            if p.is_partial() or (isinstance(p, Shard) and p.dim % query.ndim >= seq):
                raise ValueError(f"context parallel: attention's inputs are {p} on the "
                                 f"strategies' mesh; under a sequence split they may be split "
                                 f"by batch or heads only")
        out = self.attend(query.to_local(), key.to_local(), value.to_local(), self.group,
                          balanced=self.balanced, **options)
        return DTensor.from_local(out, query.device_mesh, where, run_check=False)


class ContextParallel(ModelView):
    """``module`` run on this rank's tokens of every sequence (see the module doc); ``group``
    is the context-parallel ranks, ``method`` ``"ring"`` or ``"ulysses"``. A ``ModelView``:
    parameters, state-dict keys and attributes are the model's own."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, method: str = "ring",
                 balanced: bool = True, seq_dim: int = 1, stage: bool = False) -> None:
        if method not in METHODS:
            raise ValueError(f"context parallel: method must be one of {sorted(METHODS)}, got "
                             f"{method!r}")
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation not in (None, "sdpa"):
            raise ValueError(
                f"context parallel: {type(module).__name__} computes attention with "
                f"attn_implementation={implementation!r}; the sequence split replaces "
                f"scaled_dot_product_attention calls only, so build it with "
                f"attn_implementation='sdpa'")
        takes = inspect.signature(module.forward).parameters
        if "position_ids" not in takes:
            raise ValueError(
                f"context parallel: {type(module).__name__}.forward takes no position_ids "
                f"keyword; each rank's tokens sit at other places of the sequence, so the model "
                f"must take their positions (HuggingFace decoders and the recipe GPT do)")
        super().__init__(module)
        self.group, self.method = group, method
        self.balanced, self.seq_dim = balanced, seq_dim
        self.degree, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._takes_mask = "attention_mask" in takes
        #: a pipeline stage: its inputs are already this rank's share (the pipeline cut the
        #: batch), and it may hold no attention (a stage of the embedding or the head alone)
        self.stage = stage

    def _same_for_every_row(self, row: torch.Tensor) -> torch.Tensor:
        """The positions' one row, for every batch row: under strategies a DTensor replicated
        on their mesh, which the dataset strategy (``full_batch=False``), taking every plain
        input as this rank's batch rows, leaves as it is."""
        state = semi_auto_state(self._model)
        if state is None:
            return row
        return DTensor.from_local(row, state.mesh, [Replicate()] * state.mesh.ndim,
                                  run_check=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "labels" in kwargs:
            raise ValueError("context parallel: labels= are shifted inside HuggingFace's loss, "
                             "across the chunk borders of a split sequence; pass next-token "
                             "targets (the recipe's model(idx, targets)) instead")
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.dim() <= self.seq_dim:
            raise ValueError(f"context parallel: the first tensor argument must have a sequence "
                             f"dimension {self.seq_dim}")
        length = first.shape[self.seq_dim] * (self.degree if self.stage else 1)
        check_length(length, self.degree, self.balanced)

        def cut(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim() > self.seq_dim and \
                    value.shape[self.seq_dim] == length:
                return shard_sequence(value, self.rank, self.degree, self.seq_dim, self.balanced)
            return value
        if not self.stage:
            args = tuple(cut(a) for a in args)
            kwargs = {k: cut(v) for k, v in kwargs.items()}
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = self._same_for_every_row(positions(
                length, self.rank, self.degree, self.balanced, device=first.device).unsqueeze(0))
            if self._takes_mask and kwargs.get("attention_mask") is None:
                # HuggingFace reads a jump in position_ids as packed sequences unless a mask is
                # given: an all-ones one says there is one sequence (and lets SDPA run causal)
                kwargs["attention_mask"] = torch.ones(
                    first.shape[0], length // self.degree, dtype=torch.long, device=first.device)
        split = _SplitAttention(self.group, self.method, self.balanced)
        with split:
            out = self._model(*args, **kwargs)
        if split.calls == 0 and not self.stage:  # its attention saw this rank's tokens only
            raise ValueError(
                f"context parallel: {type(self._model).__name__}'s forward made no "
                f"scaled_dot_product_attention call, so its attention (if any) saw only this "
                f"rank's share of the sequence; context parallel splits models whose attention "
                f"is F.scaled_dot_product_attention")
        return out


def context_parallel(module: nn.Module, group: dist.ProcessGroup, *, method: str = "ring",
                     balanced: bool = True) -> ContextParallel:
    """Wrap ``module`` to run on this rank's share of each sequence over ``group``'s ranks.
    Its gradients are each rank's share: average them over ``group`` (``DataParallel`` over
    it, or over data × context ranks; ``parallel.parallelize`` does this)."""
    return ContextParallel(module, group, method=method, balanced=balanced)
