"""``parallel.load_weights(model, path)``: a local checkpoint's values straight into each rank's
shards and stages, reading only the bytes the rank holds.

The model is a parallelized one (a ``Parallelized`` result or its ``.model``) or a plain one.
Its names are checked whole — the names and global shapes ``parallel.parallelize`` recorded of
the model it was given, before the split and the sharding (``parallel.weights.match``) — then
each tensor the rank holds gets its block: a whole tensor for a replica or a stage's own tensor,
a DTensor's local shard by its global offset (FSDP2, expert and semi-auto shards alike). Nothing
is written when a check fails. A model built on the meta device reads its weights while it is
materialized instead: ``parallelize(model, config, weights=path)`` or
``parallel.materialize(model, weights=path)`` (docs/deferred-init.md).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from foundation.model_view import ModelView
from parallel.result import Parallelized
from parallel.weights.files import WeightsSource, open_weights
from parallel.weights.match import ModelNames, Weights, match, model_names

#: the whole model's names, recorded by ``parallelize`` before it changes the model
_WHOLE: weakref.WeakKeyDictionary[nn.Module, ModelNames] = weakref.WeakKeyDictionary()


def remember(model: nn.Module, names: ModelNames | None = None) -> None:
    """Record ``model``'s whole names (before any parallel step) for a later load."""
    _WHOLE[model] = names if names is not None else model_names(model)


def whole_names(model: nn.Module) -> ModelNames | None:
    """The names recorded for ``model`` or the model a wrapper of it wraps (None: none)."""
    seen: nn.Module | None = model
    while seen is not None:
        if seen in _WHOLE:
            return _WHOLE[seen]
        seen = seen.module if isinstance(seen, ModelView) else None
    return None


def fill_held(weights: Weights, held: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each held ``(canonical name, tensor)`` that the file has its block; returns the
    canonical names filled. Two tensors of the rank reading one key (a tie kept as two copies)
    read it once."""
    targets: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    filled = set()
    for canonical, tensor in held:
        key = weights.keys.get(canonical)
        if key is None:
            continue
        filled.add(canonical)
        if key in targets:
            copies.append((tensor, targets[key]))
        else:
            targets[key] = tensor
    weights.source.fill(targets)  # collective for DCP: every rank calls it, targets or none
    with torch.no_grad():
        for tensor, source in copies:
            tensor.copy_(source)
    return filled


def load_weights(model: nn.Module | Parallelized, source: str | Path | WeightsSource, *,
                 strict: bool = True) -> nn.Module | Parallelized:
    """Load ``source`` (a ``.safetensors`` file, a ``save_pretrained`` directory or a DCP
    directory) into what this rank of ``model`` holds, in place; returns the model.

    strict: every parameter and persistent buffer of the whole model must be in the file and
        every file tensor must name one (else ValueError naming the key, the file and the rule);
        shapes must match always. Checked before anything is written. Collective for a DCP
        directory: every rank calls it.
    """
    rank_model = model.model if isinstance(model, Parallelized) else model
    if not isinstance(rank_model, nn.Module):
        raise TypeError(f"parallel.load_weights: expected an nn.Module or a Parallelized "
                        f"result, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"parallel.load_weights: strict must be a bool, got {strict!r}")
    held = [*rank_model.named_parameters(), *rank_model.named_buffers()]
    meta = next((n for n, t in held if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"parallel.load_weights: '{meta}' is on the meta device; a meta model "
                         f"reads its weights as it is materialized: parallelize(model, config, "
                         f"weights=path) or parallel.materialize(model, weights=path)")
    whole = whole_names(rank_model) or model_names(rank_model)
    opened = open_weights(source) if isinstance(source, (str, Path)) else source
    fill_rank(rank_model, match(whole, opened, strict, who="parallel.load_weights"),
              "parallel.load_weights", whole)
    return model


def fill_rank(rank_model: nn.Module, weights: Weights, who: str,
              whole: ModelNames | None = None) -> None:
    """``weights`` (matched to the whole model, ``whole``: default the names ``parallelize``
    recorded) into every tensor this rank of ``rank_model`` holds."""
    whole = whole or whole_names(rank_model) or model_names(rank_model)
    held = [*rank_model.named_parameters(), *rank_model.named_buffers()]
    unknown = next((n for n, _ in held if n not in whole.canonical), None)
    if unknown is not None:
        raise ValueError(f"{who}: '{unknown}' was not in the model given to "
                         f"parallel.parallelize (a step added it); nothing was loaded")
    fill_held(weights, ((whole.canonical[n], t) for n, t in held))
