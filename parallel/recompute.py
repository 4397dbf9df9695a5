"""Activation recompute: ``parallel.recompute(module, mode)`` (MindSpore's ``cell.recompute()``).

A recomputed module keeps (almost) none of its activations for backward; backward runs its
forward again to get them back. It trades compute for memory, which is what lets a layer-deep
model fit (Megatron-LM, torchtitan's ``activation_checkpoint``).

* ``mode="full"``: the module saves only its inputs; every activation inside is recomputed.
* ``mode="selective"``: the outputs of the matrix multiplications (linear layers: their inputs
  cost the most FLOPs to recompute and their outputs are small next to attention's) are kept,
  everything else is recomputed — the attention core (scores, softmax, dropout, the weighted
  sum), normalisations and activations. This is Megatron's selective recompute generalised to any
  module, on torch's op-level policy (``create_selective_checkpoint_contexts``).

* ``mode="offload"``: nothing is recomputed; what the module saves for backward is kept in host
  memory instead of on the device and brought back in backward, one layer ahead
  (:mod:`hetero.offload.activations`). It costs host-link bandwidth instead of FLOPs.

Full and selective run on torch's non-reentrant ``torch.utils.checkpoint`` (it keeps the RNG
state: a recomputed dropout draws the same mask, and it composes with DTensor, FSDP2 and autograd
hooks): losses and gradients equal the run without recompute. The module's ``forward`` is wrapped in
place, so its parameters, names, hooks and state dict stay as they are, and wrappers applied
later (semi-auto, FSDP2 units, pipeline stages) see the same module. Submodules' forward hooks run
again during the recomputation, as their forward does.

Refused by name: a ``hetero.place``'d model (its forward runs captured partitions on two devices;
recompute inside one is not built), a module recomputed twice, and an unknown mode.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from foundation.forward_wrap import wrap_forward
from hetero.offload.activations import HANDLED_ATTR as _ATTR  # the mode a module runs with
from hetero.offload.activations import SHARED as SHARED_OFFLOAD  # noqa: F401 (its name here)
from hetero.offload.activations import ActivationOffload, offload_activations
from hetero.placement import PlacedModule
from parallel.context_parallel.wrapper import split_attention

MODES = ("none", "selective", "full", "offload")

#: ops whose outputs selective recompute keeps (the matrix multiplications of linear layers)
SAVED_OPS = frozenset({
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
})


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (CheckpointPolicy.MUST_SAVE if op in SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _contexts(selective: bool) -> tuple[Any, Any]:
    """The forward and recompute contexts of one checkpointed call: selective recompute's
    policy, and the split-sequence attention of context parallel when the forward runs under it
    (backward re-runs the forward outside ``ContextParallel.forward``)."""
    forward, again = (create_selective_checkpoint_contexts(_selective_policy) if selective
                      else (contextlib.nullcontext(), contextlib.nullcontext()))
    attention = split_attention()
    return (forward, again) if attention is None else (forward, _both(again, attention))


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


_PLACED = ("parallel.recompute of a hetero.place'd model is not built: its forward runs captured "
           "partitions on two devices, not its modules' forwards; train placed models without "
           "recompute")


def _check(module: nn.Module, mode: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"parallel.recompute: expected an nn.Module, got {type(module).__name__}")
    if mode not in MODES[1:]:
        raise ValueError(f"parallel.recompute: mode {mode!r} is not one of {MODES[1:]}")
    if recompute_mode(module) is not None:
        raise ValueError(f"parallel.recompute: {type(module).__name__} is already recomputed "
                         f"(mode {recompute_mode(module)!r})")
    if isinstance(module, PlacedModule):
        raise ValueError(_PLACED)


def recompute(module: nn.Module, mode: str = "full",
              offload: ActivationOffload | None = None) -> nn.Module:
    """Recompute ``module``'s activations in backward, or with ``mode="offload"`` keep them in
    host memory (``offload``: the :class:`ActivationOffload` to use, default
    :data:`SHARED_OFFLOAD`); see the module docstring. Returns ``module``, changed in place."""
    _check(module, mode)
    if mode == "offload":
        return offload_activations(module, offload)
    def context_fn() -> tuple[Any, Any]:
        return _contexts(mode == "selective")

    def recomputed(forward: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if not torch.is_grad_enabled():  # inference: nothing is saved anyway
            return forward(*args, **kw)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kw)

    wrap_forward(module, recomputed)
    setattr(module, _ATTR, mode)
    return module


def recompute_mode(module: nn.Module) -> str | None:
    """The mode ``module`` is recomputed with, or None."""
    return getattr(module, _ATTR, None)


def recompute_layers(model: nn.Module, pattern: str, mode: str) -> list[str]:
    """Recompute every module of ``model`` whose path matches ``pattern`` (``fnmatch``, e.g.
    ``"blocks.*"`` for a GPT's transformer blocks); returns their paths. ``mode="none"`` changes
    nothing. ValueError, before any change, when no module matches."""
    if mode == "none":
        return []
    if mode not in MODES:
        raise ValueError(f"parallel.recompute: mode {mode!r} is not one of {MODES}")
    depth = pattern.count(".")  # "blocks.*": the blocks, not their submodules
    found = [(p, m) for p, m in model.named_modules()
             if p and p.count(".") == depth and fnmatch.fnmatchcase(p, pattern)]
    if not found:
        raise ValueError(f"parallel.recompute: no module of {type(model).__name__} matches "
                         f"{pattern!r}")
    if any(isinstance(m, PlacedModule) for m in (model, *model.modules())):
        raise ValueError(_PLACED)  # its blocks' forwards never run: captured graphs do
    for _, module in found:
        _check(module, mode)
    for _, module in found:
        recompute(module, mode)
    return [p for p, _ in found]
