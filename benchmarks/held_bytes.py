"""Activation memory of a forward: the bytes of the tensors it made that are still alive when it
returns — what autograd (or a recompute policy) keeps for backward, plus the output. That is the
peak of activation memory in a training step (it only falls as backward runs), on any device,
without an allocator's statistics (the CPU has none).

A dispatch mode sees every tensor an operator returns and keeps a weak reference to its storage
(a storage shared by views is counted once); what is alive after the forward is what was held.
``tests/test_recompute.py`` asserts with this same instrument.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class HeldBytes(TorchDispatchMode):
    """``with HeldBytes() as h: out = model(x)``; then ``h.held()``: bytes still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def held(self) -> int:
        """Bytes of the storages made inside that are still alive now."""
        return sum(n for ref, n in self.refs.values() if not ref.expired())
