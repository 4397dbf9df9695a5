"""The host-table lookup as torch custom ops: exportable, with a row-sparse gradient.

``hetero::host_embedding_lookup(table, indices, output_device)`` gathers rows of a table that
lives in host memory and returns them on ``output_device``. When that is an accelerator, the host
gathers only the *unique* indices' rows into pinned memory, those rows and the inverse index cross
(non-blocking), and the accelerator expands them to one row per index; the backward reduces the
output gradient to one row per unique index on the accelerator, and only those rows come back.
When the output stays on the host there is nothing to ship, so the rows are gathered straight
from the table. Either way the table's gradient is a coalesced sparse COO tensor on the host
(one row per distinct index, sorted), which the sparse optimizers update without coalescing again.

Why a custom op and not ``F.embedding(sparse=True)`` plus ``.to(device)``: ``hetero.place``
captures models with ``torch.export`` on meta tensors, and the unique-rows count is data
dependent. Inside one op with a fake implementation, the graph sees only fixed shapes (indices in,
``[*indices.shape, D]`` out), so placement, plans and ``auto_place`` work unchanged, while the real
kernel ships only the distinct rows. ``F.embedding(sparse=True)`` would also hand the optimizer an
uncoalesced gradient with one row per index (duplicates included), which it must then coalesce.

``hetero::checked_indices(indices, vocab_size)`` is the range check of a table on the accelerator:
an out-of-range index there would be a device-side assert (a crashed context), not an error.
"""

from __future__ import annotations

from typing import Any

import torch

from foundation import device as hd

_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                             torch.uint16, torch.uint32, torch.uint64})


def check_index_dtype(indices: Any, owner: str) -> None:
    """TypeError unless ``indices`` is a tensor of an integer dtype (bool is not an index)."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{owner}: indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in _INTEGER_DTYPES:
        raise TypeError(f"{owner}: indices must have an integer dtype, got {indices.dtype}")


def _as_int64(indices: torch.Tensor) -> torch.Tensor:
    # uint64 has few kernels; values past int64's range wrap negative and fail the range check.
    return indices.to(torch.int64) if indices.dtype != torch.int64 else indices


def check_range(flat: torch.Tensor, vocab_size: int, sorted_unique: bool = False) -> None:
    """IndexError naming the first index of ``flat`` outside [0, vocab_size). The min and max
    are read at once (one host sync on an accelerator); of sorted uniques, at the ends."""
    if not flat.numel():
        return
    lo, hi = (flat[[0, -1]] if sorted_unique else torch.stack(torch.aminmax(flat))).tolist()
    if lo >= 0 and hi < vocab_size:
        return
    bad = flat[(flat < 0) | (flat >= vocab_size)][0].item()
    raise IndexError(
        f"EmbeddingLookup: index {bad} is out of range for vocab_size {vocab_size} "
        f"(valid indices are 0 .. {vocab_size - 1})"
    )


def _host_flat(indices: torch.Tensor) -> torch.Tensor:
    flat = indices.reshape(-1)
    if flat.device.type != "cpu":  # ids from the device land in pinned memory
        flat = hd.copy_to(flat, torch.device("cpu"))
    return _as_int64(flat)


def _unique(flat: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted distinct indices and each index's position among them; range-checked for free
    (the ends of the sorted uniques are the min and the max)."""
    uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    check_range(uniq, vocab_size, sorted_unique=True)
    return uniq, inverse


def _ships(device: torch.device) -> bool:
    """Whether rows must cross to ``device`` (not when it is the host itself)."""
    return device.type != "cpu"


@torch.library.custom_op("hetero::host_embedding_lookup", mutates_args=())
def host_embedding_lookup(table: torch.Tensor, indices: torch.Tensor,
                          output_device: str) -> torch.Tensor:
    """Rows ``table[indices]`` (host table) as a ``[*indices.shape, D]`` tensor on
    ``output_device`` (a name for ``hetero.device.resolve``: "cpu", "device", or a concrete
    accelerator)."""
    if table.device.type != "cpu":
        raise ValueError(f"EmbeddingLookup(target='CPU'): the table must be in host memory but "
                         f"is on {table.device} (tagged hetero.set_device(..., 'device')? use "
                         f"target='DEVICE' for a table on the accelerator)")
    device = hd.resolve(output_device)
    flat, dim = _host_flat(indices), table.shape[1]
    if not _ships(device):
        check_range(flat, table.shape[0])
        return table.index_select(0, flat).view(*indices.shape, dim)
    uniq, inverse = _unique(flat, table.shape[0])
    rows = hd.pinned_empty((uniq.numel(), dim), table.dtype)
    torch.index_select(table, 0, uniq, out=rows)  # gathered straight into pinned memory
    expanded = torch.nn.functional.embedding(hd.copy_to(inverse, device), hd.copy_to(rows, device))
    return expanded.view(*indices.shape, dim)


@host_embedding_lookup.register_fake
def _(table: torch.Tensor, indices: torch.Tensor, output_device: str) -> torch.Tensor:
    # During hetero.place's capture everything is on meta and must stay there.
    device = table.device if table.device.type == "meta" else hd.resolve(output_device)
    return table.new_empty((*indices.shape, table.shape[1]), device=device)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    table, indices, _ = inputs
    ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
    ctx.save_for_backward(indices)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
    if not ctx.needs_input_grad[0]:
        return None, None, None
    (indices,) = ctx.saved_tensors
    vocab_size, dim = ctx.table_shape
    # The forward's unique is recomputed rather than returned: as an output its data-dependent
    # length would reach the captured graph and every plan built from it.
    uniq, inverse = _unique(_host_flat(indices), vocab_size)
    grad = grad.reshape(-1, dim)
    if grad.device.type == "cpu":  # index_add_ measured ~2x embedding_dense_backward's speed here
        rows = grad.new_zeros((uniq.numel(), dim)).index_add_(0, inverse, grad)
    else:  # sort-based and deterministic on accelerators (index_add_ uses atomics there)
        rows = torch.ops.aten.embedding_dense_backward(
            grad, hd.copy_to(inverse, grad.device), uniq.numel(), -1, False)
        rows = hd.pinned_empty(rows.shape, rows.dtype).copy_(rows)  # blocking: read right away
    sparse = torch.sparse_coo_tensor(uniq.unsqueeze(0), rows.to(ctx.table_dtype),
                                     ctx.table_shape, is_coalesced=True, check_invariants=False)
    return sparse, None, None


host_embedding_lookup.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("hetero::checked_indices", mutates_args=())
def checked_indices(indices: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``indices`` as int64 after checking they lie in [0, vocab_size) (one host sync)."""
    checked = indices.to(torch.int64, copy=True)
    check_range(checked.reshape(-1), vocab_size)
    return checked


@checked_indices.register_fake
def _(indices: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.empty_like(indices, dtype=torch.int64)
