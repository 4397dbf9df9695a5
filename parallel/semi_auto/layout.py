"""Tensor layouts in the reference's terms: a device matrix and a tensor map.

A ``TensorLayout`` says how one tensor is spread over the devices. ``device_matrix`` arranges the
ranks row-major into a matrix (rank 5 of ``(2, 4)`` sits at row 1, column 1); ``tensor_map`` has
one entry per tensor dimension naming the device-matrix axis that slices it, counted from the
*right* (0 is the last axis), ``-1`` for a dimension that is not split, or a tuple of axes (outer
first) for a dimension split over several. ``partial`` lists the axes over which the tensor holds
partial sums (the output of a matrix multiplication whose contracting dimension is split).

``Layout`` is the user-facing builder of the reference (MindSpore's ``Layout``): name the axes
of a device matrix, then call it with one axis name (or "None") per tensor dimension::

    layout = Layout((2, 2), ("dp", "mp"))
    layout("dp", "None").tensor_map        # (1, -1)
    layout(("dp", "mp"), "None").tensor_map  # ((1, 0), -1): dim 0 split 4 ways

This module is plain data; ``parallel.semi_auto.mesh`` turns layouts into DTensor placements.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

#: One tensor dimension's entry in a tensor map: -1, an axis (from the right) or axes (outer first).
DimMap = int | tuple[int, ...]


def dim_axes(entry: DimMap) -> tuple[int, ...]:
    """The axes (counted from the right, outer first) that slice a dimension; () if none."""
    if isinstance(entry, tuple):
        return entry
    return () if entry == -1 else (entry,)


def as_dim_map(axes: Sequence[int]) -> DimMap:
    """The tensor-map entry for ``axes``: -1 when empty, an int for one axis, else a tuple."""
    axes = tuple(axes)
    return -1 if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one tensor is sliced over a device matrix (see the module docstring)."""

    device_matrix: tuple[int, ...]
    tensor_map: tuple[DimMap, ...]
    partial: tuple[int, ...] = ()
    alias_name: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.device_matrix)
        used: list[int] = []
        for dim, entry in enumerate(self.tensor_map):
            axes = dim_axes(entry)
            for axis in axes:
                if not 0 <= axis < n:
                    raise ValueError(f"tensor_map {self.tensor_map}: dimension {dim} names axis "
                                     f"{axis}, but device_matrix {self.device_matrix} has axes "
                                     f"0..{n - 1} (counted from the right)")
            if list(axes) != sorted(axes, reverse=True):
                raise ValueError(f"tensor_map {self.tensor_map}: dimension {dim} is split over "
                                 f"axes {axes}; list them outer first (left to right in the "
                                 f"device matrix), e.g. {tuple(sorted(axes, reverse=True))}")
            used += axes
        used += self.partial
        if len(used) != len(set(used)):
            raise ValueError(f"tensor_map {self.tensor_map} (partial {self.partial}) uses a "
                             f"device axis twice: each axis slices at most one dimension")

    @property
    def rank(self) -> int:
        return len(self.tensor_map)

    def axis_size(self, axis: int) -> int:
        """Size of the axis counted ``axis`` places from the right."""
        return self.device_matrix[len(self.device_matrix) - 1 - axis]

    def slices(self) -> tuple[int, ...]:
        """How many slices each dimension is cut into (the strategy tuple of this layout)."""
        return tuple(math.prod(self.axis_size(a) for a in dim_axes(e)) for e in self.tensor_map)

    def __str__(self) -> str:
        text = f"device_matrix={self.device_matrix} tensor_map={self.tensor_map}"
        return text + (f" partial={self.partial}" if self.partial else "")


class Layout:
    """A named device matrix; call it with axis names per tensor dimension to get a layout."""

    def __init__(self, device_matrix: Sequence[int], alias_name: Sequence[str]) -> None:
        device_matrix, alias_name = tuple(device_matrix), tuple(alias_name)
        if not device_matrix or any(
                not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in device_matrix):
            raise ValueError(f"Layout device_matrix {device_matrix} must be positive integers")
        if len(alias_name) != len(device_matrix):
            raise ValueError(f"Layout alias_name {alias_name} must name each of the "
                             f"{len(device_matrix)} axes of device_matrix {device_matrix}")
        if len(set(alias_name)) != len(alias_name) or "None" in alias_name or not all(
                isinstance(a, str) and a for a in alias_name):
            raise ValueError(f"Layout alias_name {alias_name} must be distinct non-empty strings "
                             f"other than 'None' (which means 'not split')")
        self.device_matrix, self.alias_name = device_matrix, alias_name

    def _axis(self, name: str) -> int:
        if name not in self.alias_name:
            raise ValueError(f"Layout: unknown axis name {name!r}; the axes are "
                             f"{self.alias_name} (or 'None' for a dimension that is not split)")
        return len(self.alias_name) - 1 - self.alias_name.index(name)

    def __call__(self, *dims: str | Sequence[str]) -> TensorLayout:
        """One entry per tensor dimension: an axis name, "None", or a tuple of names."""
        tensor_map: list[DimMap] = []
        for entry in dims:
            names = (entry,) if isinstance(entry, str) else tuple(entry)
            axes = [self._axis(n) for n in names if n != "None"]
            tensor_map.append(as_dim_map(axes))
        return TensorLayout(self.device_matrix, tuple(tensor_map), alias_name=self.alias_name)

    def __repr__(self) -> str:
        return f"Layout(device_matrix={self.device_matrix}, alias_name={self.alias_name})"
