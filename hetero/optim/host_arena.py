"""Flat host buffers shared by a list of parameters, one slice per parameter.

The offloaded optimizer keeps the FP32 master weights, both Adam moments, a landing buffer for
gradients and a send buffer for the 16-bit weights of many parameters. Allocating them as one flat
buffer per kind, instead of one tensor per parameter, matters for three reasons:

* pinned memory is page-locked by the accelerator runtime, and its caching host allocator rounds
  every request up to a power of two: per-parameter pinned tensors can waste up to half of the
  bytes each. One flat buffer does too (1.1 GiB pins 2 GiB), so where pinning happens the
  optimizer cuts a group into several arenas along parameter boundaries, each within a stated
  bound of its power of two (``pinned_chunks.py``); a few large buffers instead of many small
  ones, each wasting at most that bound;
* a run of neighbouring parameters becomes one contiguous slice, so the host kernel is called once
  per run rather than once per parameter;
* the per-parameter views (``view``) are what ``state_dict()`` hands out, in the exact shapes
  ``torch.optim.AdamW`` uses.
"""

from __future__ import annotations

import torch

from foundation import device as hd


class HostArena:
    """Named flat host buffers laid out identically: parameter ``i`` owns ``[offset_i, +numel_i)``.

    ``pinned`` buffers are page-locked where an accelerator is present (transfers from and to
    them run asynchronously); buffers only the host touches are plain memory.
    """

    def __init__(self, shapes: list[torch.Size], device: torch.device | None = None) -> None:
        self.shapes = list(shapes)
        #: where the buffers live: host memory (None), or beside parameters kept on their device
        #: (a param group with ``offload=False``)
        self.device = device
        self.offsets: list[int] = []
        total = 0
        for shape in self.shapes:
            self.offsets.append(total)
            total += shape.numel()
        self.numel = total
        self._buffers: dict[str, torch.Tensor] = {}

    def add(self, name: str, dtype: torch.dtype, *, pinned: bool, zero: bool = False) -> None:
        """Allocate buffer ``name`` (no-op when it exists with the same dtype)."""
        if name in self._buffers:
            if self._buffers[name].dtype != dtype:
                raise ValueError(f"arena buffer {name!r} exists with dtype "
                                 f"{self._buffers[name].dtype}, asked for {dtype}")
            return
        if pinned and self.device is None:
            buf = hd.pinned_empty((self.numel,), dtype)
        else:
            buf = torch.empty(self.numel, dtype=dtype, device=self.device)
        if zero:
            buf.zero_()
        self._buffers[name] = buf

    def has(self, name: str) -> bool:
        return name in self._buffers

    def flat(self, name: str) -> torch.Tensor:
        """The whole flat buffer ``name``."""
        return self._buffers[name]

    def span(self, name: str, first: int, last: int) -> torch.Tensor:
        """Flat slice of ``name`` covering parameters ``first`` .. ``last`` (inclusive)."""
        start = self.offsets[first]
        stop = self.offsets[last] + self.shapes[last].numel()
        return self._buffers[name][start:stop]

    def view(self, name: str, index: int) -> torch.Tensor:
        """Parameter ``index``'s slice of ``name``, in the parameter's shape."""
        return self.span(name, index, index).view(self.shapes[index])

    @property
    def on_host(self) -> bool:
        return self.device is None or self.device.type == "cpu"

    def nbytes(self) -> int:
        """Bytes held by all buffers of this arena."""
        return sum(b.nbytes for b in self._buffers.values())
