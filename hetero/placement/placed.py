"""``hetero.place``: the placed model, an ``nn.Module`` that runs its per-device partitions.

The placed model is a view of the original (``ModelView``): ``parameters()``, ``state_dict()``
keys and optimizers are exactly the original's; only where the tensors live changes. Forward keeps
the original signature and output structure (pytree specs from ``torch.export``). Each new input
signature (shapes, dtypes, devices, non-tensor values, train/eval) is captured once and cached:
batch and sequence sizes may change between calls.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from hetero import device as hd
from hetero.placement.capture import capture
from hetero.placement.plan import Plan
from hetero.placement.runtime import PartitionRunner
from hetero.placement.split import apply_homes, split


@dataclasses.dataclass
class _Placement:
    runner: PartitionRunner
    plan: Plan
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec


def _leaf_key(leaf: Any) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf), id(leaf))
    return ("value", type(leaf), leaf)  # captured as a constant: another value re-captures


def check_signature(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise TypeError when ``args``/``kwargs`` cannot be passed to ``model.forward``."""
    sig = inspect.signature(model.forward)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(
            f"example inputs do not match {type(model).__name__}.forward{sig}: {err}"
        ) from None


class ModelView(nn.Module):
    """An ``nn.Module`` that *is* ``model`` for parameters, buffers, submodules and attributes.

    The registries are shared, not copied: ``parameters()``, ``state_dict()`` keys, optimizers and
    ``train()``/``eval()`` are exactly the original's. Attributes the view lacks (a ``config``,
    helper methods) come from the original. Subclasses decide what ``forward`` does.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.training = model.training
        object.__setattr__(self, "_model", model)  # not a submodule: keys stay unprefixed

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None:
                raise
            return getattr(model, name)

    @property
    def model(self) -> nn.Module:
        """The original model (same tensors, now on their planned devices)."""
        return self._model


class PlacedModule(ModelView):
    """A model split into CPU and accelerator partitions (see :func:`place`)."""

    def __init__(self, model: nn.Module, default: str,
                 overrides: dict[nn.Module, str] | None = None) -> None:
        super().__init__(model)
        self._default = hd.logical_name(default)
        self._overrides = dict(overrides or {})
        self._placements: dict[tuple, _Placement] = {}
        self._last: _Placement | None = None

    @property
    def plan(self) -> Plan:
        """Partitions of the most recent capture, in execution order."""
        if self._last is None:
            raise RuntimeError(
                "this placed model has not been captured yet: call it once, or pass "
                "example_inputs to hetero.place"
            )
        return self._last.plan

    def _key(self, args: tuple, kwargs: dict) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return (self.training, str(spec), tuple(_leaf_key(x) for x in leaves))

    def _default_input_device(self, value: Any) -> str | None:
        if not isinstance(value, torch.Tensor):
            return None
        if value.device == hd.resolve(self._default):
            return self._default
        return hd.logical_name(value.device)

    def capture(self, args: tuple, kwargs: dict) -> _Placement:
        """Capture and split for this input signature (cached), moving tensors to their homes."""
        key = self._key(args, kwargs)
        if key not in self._placements:
            check_signature(self._model, args, kwargs)
            self._model.training = self.training  # children share the flag already
            captured = capture(self._model, args, kwargs)
            leaves = pytree.tree_leaves((args, kwargs))
            split_gm, plan = split(captured, self._model, self._default, self._overrides,
                                   [self._default_input_device(x) for x in leaves])
            apply_homes(self._model, plan.tensor_home)
            self._placements[key] = _Placement(PartitionRunner(split_gm, plan), plan,
                                               captured.in_spec, captured.out_spec)
        self._last = self._placements[key]
        return self._last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        placement = self.capture(args, kwargs)
        flat = fx_pytree.tree_flatten_spec((args, kwargs), placement.in_spec)
        out = placement.runner.run(list(flat))
        return pytree.tree_unflatten(list(out), placement.out_spec)

    def extra_repr(self) -> str:
        return f"default={self._default!r}, captures={len(self._placements)}"


def place(model: nn.Module, example_inputs: tuple | None = None, *,
          example_kwargs: dict | None = None, default: str = "device",
          mode: str = "graph") -> nn.Module:
    """Split ``model`` into CPU and accelerator partitions by its ``set_device`` tags.

    Returns an ``nn.Module`` with the original forward signature and output. With
    ``example_inputs`` (and/or ``example_kwargs``) the model is captured, split and its tensors
    moved now; otherwise on the first call. ``mode="hooks"`` is the fallback for models
    ``torch.export`` cannot capture (see ``hetero.placement.hooks``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"hetero.place places an nn.Module, got {type(model).__name__}")
    if mode == "hooks":
        from hetero.placement.hooks import place_with_hooks

        return place_with_hooks(model, default=default)
    if mode != "graph":
        raise ValueError(f"mode must be 'graph' or 'hooks', got {mode!r}")
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    placed = PlacedModule(model, default)
    if example_inputs is not None or example_kwargs is not None:
        placed.capture(example_inputs or (), example_kwargs or {})
    return placed
