"""The placed model's capture cache: one capture per input signature, bounded, guarded.

A capture is specialised to what export saw: input shapes, dtypes and devices, every non-tensor
argument's value, train/eval, and the module attributes forward reads. The key covers the
arguments; a guard covers the attributes (every public int/float/bool/str/None attribute of
every module, ``training`` included: changing ``model.scale`` or ``model.dropout.eval()`` after
capture re-captures instead of running the stale graph). The cache is an LRU of ``size``
entries; when a call keeps missing it because a non-tensor argument changes every time (a Python
float such as a temperature, which export records as a constant), or because shapes churn
through the whole cache, it warns once with the fix. A dropped capture (evicted, or replaced
because its guard failed) is handed to ``on_drop``, which releases what outlives it elsewhere.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from foundation.compat import pytree

_SIMPLE = (int, float, bool, str, type(None))
_MISSING = object()
RECAPTURE_WARN_AFTER = 3


def _leaf_key(leaf: Any) -> tuple:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf), id(leaf))
    return ("value", type(leaf), leaf)  # captured as a constant: another value re-captures


def attribute_guard(model: nn.Module) -> list[tuple[dict, str, Any]]:
    """(module ``__dict__``, name, value) for every simple public attribute of every module."""
    return [(m.__dict__, k, v) for m in model.modules() for k, v in m.__dict__.items()
            if (k == "training" or k[0] != "_") and isinstance(v, _SIMPLE)]


def guard_holds(guard: list[tuple[dict, str, Any]]) -> bool:
    for namespace, name, value in guard:
        now = namespace.get(name, _MISSING)
        if now is not value and now != value:
            return False
    return True


class CaptureCache:
    """LRU of captures keyed by the call's signature (see the module docstring)."""

    def __init__(self, size: int, model_name: str,
                 on_drop: Callable[[Any], None] | None = None) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"cache_size must be a positive int (captures kept), got {size!r}")
        self.size, self.model_name = size, model_name
        self._on_drop = on_drop
        self.entries: OrderedDict[tuple, tuple[Any, list]] = OrderedDict()
        self.captures = 0
        self._last_key: tuple | None = None
        self._value_misses: dict[str, int] = {}
        self._warned = False

    def __len__(self) -> int:
        return len(self.entries)

    @staticmethod
    def key(training: bool, args: tuple, kwargs: dict) -> tuple:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return (training, str(spec), tuple(_leaf_key(x) for x in leaves))

    def get(self, key: tuple, model: nn.Module, build: Callable[[], Any],
            args: tuple, kwargs: dict) -> Any:
        """The cached capture for ``key`` whose guard holds, else ``build()``'s (cached)."""
        entry = self.entries.get(key)
        if entry is not None and guard_holds(entry[1]):
            self.entries.move_to_end(key)
            return entry[0]
        value = build()
        self.captures += 1
        self._note_miss(key, args, kwargs)
        if entry is not None:  # its guard failed: the new capture replaces it
            self._drop(self.entries.pop(key)[0])
        self.entries[key] = (value, attribute_guard(model))
        if len(self.entries) > self.size:
            self._drop(self.entries.popitem(last=False)[1][0])
            self._warn(f"its {self.size}-entry cache is full and the oldest capture was "
                       f"dropped: input shapes or values keep changing. Pad or bucket the "
                       f"shapes, or raise hetero.place(..., cache_size=N)")
        self._last_key = key
        return value

    def _drop(self, value: Any) -> None:
        if self._on_drop is not None:
            self._on_drop(value)

    def _note_miss(self, key: tuple, args: tuple, kwargs: dict) -> None:
        last = self._last_key
        if last is None or last[:2] != key[:2]:
            return
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path((args, kwargs))[0]]
        for path, old, new in zip(paths, last[2], key[2], strict=False):
            if old[0] == new[0] == "value" and old != new:
                self._value_misses[path] = self._value_misses.get(path, 0) + 1
                if self._value_misses[path] >= RECAPTURE_WARN_AFTER:
                    self._warn(f"argument {path} (a {new[1].__name__}) took a new value on "
                               f"{self._value_misses[path]} calls, and export records such "
                               f"values as constants, so each new value is a new capture. Pass "
                               f"it as a tensor (torch.tensor(value)), or set it on the module")

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"hetero.place re-captured {self.model_name} {self.captures} times: "
                          f"{why}", RuntimeWarning, stacklevel=5)
