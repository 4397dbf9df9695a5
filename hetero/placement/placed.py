"""``hetero.place``: the placed model, an ``nn.Module`` that runs its per-device partitions.

The placed model is a view of the original (``ModelView``): ``parameters()``, ``state_dict()``
keys and optimizers are exactly the original's; only where the tensors live changes. Forward keeps
the original signature and output structure (pytree specs from ``torch.export``). Each new input
signature (shapes, dtypes, devices, non-tensor values, train/eval) is captured once and kept in a
bounded, guarded cache (``cache.py``): batch and sequence sizes may change between calls.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from typing import Any

import torch
from torch import nn

from foundation import device as hd
from foundation.compat import (
    fake_dispatch_keys,
    forget_fake_dispatch,
    forget_fx_sources,
    fx_generated_sources,
    fx_pytree,
    graph_module_sources,
    pytree,
)
from foundation.model_view import ModelView
from hetero.placement.cache import CaptureCache
from hetero.placement.capture import CAPTURE_LOCK, capture, capture_error
from hetero.placement.plan import Plan
from hetero.placement.runtime import PartitionRunner
from hetero.placement.split import apply_homes, split


@dataclasses.dataclass
class _Placement:
    runner: PartitionRunner
    plan: Plan
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    sources: set[str]  # the generated fx sources its graph modules run (forgotten when dropped)


def check_signature(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise TypeError when ``args``/``kwargs`` cannot be passed to ``model.forward``."""
    sig = inspect.signature(model.forward)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(
            f"example inputs do not match {type(model).__name__}.forward{sig}: {err}"
        ) from None


class PlacedModule(ModelView):
    """A model split into CPU and accelerator partitions (see :func:`place`)."""

    def __init__(self, model: nn.Module, default: str,
                 overrides: dict[nn.Module, str] | None = None, cache_size: int = 8,
                 ops_only: dict[str, str] | None = None) -> None:
        super().__init__(model)
        self._default = hd.logical_name(default)
        self._overrides = dict(overrides or {})
        self._ops_only = dict(ops_only or {})
        self._placements = CaptureCache(cache_size, type(model).__name__,
                                        on_drop=lambda p: forget_fx_sources(p.sources))
        self._lock = threading.Lock()  # one capture at a time per placed model
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

    def _default_input_device(self, value: Any) -> str | None:
        if not isinstance(value, torch.Tensor):
            return None
        if value.device == hd.resolve(self._default):
            return self._default
        return hd.logical_name(value.device)

    def _build(self, args: tuple, kwargs: dict) -> _Placement:
        """Capture and split. Every ``GraphModule.recompile`` on the way leaves its generated
        source in fx's loader and ``linecache`` for good (see ``foundation.compat``); the sources
        of graphs that did not survive are forgotten now, the placement's own when it is dropped.
        Fake tensors' class-level dispatch cache keeps an entry per op and constant argument (a
        new float, a new entry): the entries this capture added are forgotten too. The capture
        lock keeps other placed models' captures out of the window."""
        placement = None
        with CAPTURE_LOCK:
            sources, dispatch = fx_generated_sources(), fake_dispatch_keys()
            try:
                placement = self._capture_and_split(args, kwargs)
            finally:
                forget_fake_dispatch(fake_dispatch_keys() - dispatch)
                kept = placement.sources if placement is not None else set()
                forget_fx_sources(fx_generated_sources() - sources - kept)
        return placement

    def _capture_and_split(self, args: tuple, kwargs: dict) -> _Placement:
        check_signature(self._model, args, kwargs)
        captured = capture(self._model, args, kwargs)
        leaves = pytree.tree_leaves((args, kwargs))
        try:
            split_gm, plan = split(captured, self._model, self._default, self._overrides,
                                   [self._default_input_device(x) for x in leaves],
                                   self._ops_only)
        except (ValueError, TypeError):
            raise  # the plan's own refusals: they name the tag or tensor at fault
        except Exception as err:
            raise capture_error(self._model, err, "while splitting the captured graph") from err
        apply_homes(self._model, plan.tensor_home)
        return _Placement(PartitionRunner(split_gm, plan), plan, captured.in_spec,
                          captured.out_spec, graph_module_sources(split_gm))

    def capture(self, args: tuple, kwargs: dict) -> _Placement:
        """Capture and split for this input signature (cached), moving tensors to their homes."""
        key = self._placements.key(self._model.training, args, kwargs)
        with self._lock:
            self._last = self._placements.get(key, self._model,
                                              lambda: self._build(args, kwargs), args, kwargs)
            return self._last

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        placement = self.capture(args, kwargs)
        flat = fx_pytree.tree_flatten_spec((args, kwargs), placement.in_spec)
        # the graph was captured on contiguous twins of the inputs (capture.py: empty_like),
        # so a strided input (a slice of a batch) is laid out as the graph assumes
        flat = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in flat]
        out = placement.runner.run(flat)
        return pytree.tree_unflatten(list(out), placement.out_spec)

    def extra_repr(self) -> str:
        return f"default={self._default!r}, cached captures={len(self._placements)}"


def _drop_kv_cache(model: nn.Module) -> None:
    """A HuggingFace model returns its key/value cache (a ``DynamicCache`` object, which
    ``torch.export`` cannot return) unless ``config.use_cache`` is off; training never reads it,
    so a placed model runs without it (said once, in a warning)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False
        warnings.warn(f"hetero.place: set {type(model).__name__}.config.use_cache=False: a "
                      f"placed model is captured as a graph, which cannot return the key/value "
                      f"cache object (training does not use it)", stacklevel=3)


def place(model: nn.Module, example_inputs: tuple | None = None, *,
          example_kwargs: dict | None = None, default: str = "device",
          mode: str = "graph", cache_size: int = 8) -> nn.Module:
    """Split ``model`` into CPU and accelerator partitions by its ``set_device`` tags.

    Returns an ``nn.Module`` with the original forward signature and output. With
    ``example_inputs`` (and/or ``example_kwargs``) the model is captured, split and its tensors
    moved now; otherwise on the first call. ``mode="hooks"`` is the fallback for models
    ``torch.export`` cannot capture (see ``hetero.placement.hooks``). ``cache_size`` bounds how
    many input signatures stay captured (least recently used dropped first).
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
    _drop_kv_cache(model)
    placed = PlacedModule(model, default, cache_size=cache_size)
    if example_inputs is not None or example_kwargs is not None:
        placed.capture(example_inputs or (), example_kwargs or {})
    return placed
