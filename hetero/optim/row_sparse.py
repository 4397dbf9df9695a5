"""What the row-sparse optimizers (LazyAdam, FTRL) share: gradients read as rows, and the
gather → update → scatter step over the rows a gradient touches.

For a row-sparse gradient only the rows present are updated: they are gathered from the weight and
its state into scratch buffers, updated there by vectorised torch ops, and scattered back. The
buffers live as long as the optimizer and grow to the most rows one step has touched (at most the
ids in a batch), instead of fresh tensors each step: fresh 100 MB tensors cost their page faults
every step, which measured as much as the update itself. They are not part of ``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from foundation import device as hd
from foundation.compat import sparse_coo_parts
from hetero.nn.row_blocks import row_shard_of, state_made_elsewhere, zeros_for_state
from hetero.nn.row_sharded import as_block, as_global


def sparse_rows(grad: torch.Tensor, param: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """A sparse COO gradient as (row indices, row values, row shape), duplicates summed.

    Rows are ``param`` viewed as ``[-1, *row_shape]`` (the dims after the sparse ones), so a
    ``[V, D]`` table with a 1-sparse-dim gradient has rows of ``D``; the indices come out sorted
    and distinct. A gradient that already is coalesced is used as it is, flag or not: autograd's
    gradient accumulation drops the flag, and coalescing again would sort it for nothing.
    """
    if not param.is_contiguous():
        raise ValueError("a parameter with a sparse gradient must be contiguous (its rows are "
                         "updated through a view)")
    sparse_dims = grad.sparse_dim()
    row_shape = tuple(param.shape[sparse_dims:])
    indices, values = sparse_coo_parts(grad)
    if sparse_dims > 1:  # linear row index over the sparse dims, row-major (the strides as
        # Python numbers: kernel arguments, not a tensor copied from the host)
        dims = param.shape[:sparse_dims]
        linear = indices[0] * math.prod(dims[1:])
        for d in range(1, sparse_dims):
            linear = linear + indices[d] * math.prod(dims[d + 1:])
        indices = linear.unsqueeze(0)
    rows = indices[0]
    if not (grad.is_coalesced() or bool((rows[1:] > rows[:-1]).all())):
        num_rows = param.numel() // math.prod(row_shape)
        merged = torch.sparse_coo_tensor(indices, values, (num_rows, *row_shape),
                                         check_invariants=True).coalesce()
        rows, values = merged.indices()[0], merged.values()
    return rows, values, row_shape


def rename_alias(owner: str, group: dict[str, Any], alias: str, name: str) -> dict[str, Any]:
    """``group`` with ``alias`` (MindSpore's name, e.g. ``learning_rate``) renamed to ``name``
    (torch's, e.g. ``lr``); giving both is an error unless they agree."""
    if alias not in group:
        return group
    group = dict(group)
    value = group.pop(alias)
    if name in group and group[name] != value:
        raise ValueError(f"{owner}: give {name} or {alias} (another name for it), not both")
    group[name] = value
    return group


class RowSparseOptimizer(torch.optim.Optimizer):
    """Base of the sparse optimizers: validated groups, ``target``, and the row update."""

    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyper-parameters are checked like the constructor's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            for p in group["params"]:
                if p.layout is not torch.strided:
                    raise TypeError(f"{type(self).__name__}: parameters must be dense (strided) "
                                    f"tensors; sparse gradients are fine, got a {p.layout} one")
        except (TypeError, ValueError):
            self.param_groups.pop()  # nothing half-applied
            raise

    def state_dict(self) -> dict[str, Any]:
        """torch's, with the per-row state of a row-sharded table (``EmbeddingLookup(sharding=
        "row")``) presented whole, as ``Shard(0)`` DTensors over its ranks (see
        :func:`hetero.nn.row_sharded.as_global`), so DCP saves and re-shards it like the table."""
        out = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, state in out["state"].items():
            shard = row_shard_of(params[index])
            if shard is None:
                continue
            out["state"][index] = {
                k: as_global(v, *shard) if isinstance(v, torch.Tensor)
                and v.shape == params[index].shape else v for k, v in state.items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, taking this rank's block of row-sharded state back out of its DTensors; the
        state of a table at rest in a file stays in files (a checkpoint loaded in place is
        there already; anything else is copied into new ones)."""
        state_dict = dict(state_dict)
        state_dict["state"] = {index: {k: as_block(v) for k, v in state.items()}
                               for index, state in state_dict["state"].items()}
        params = [p for g in self.param_groups for p in g["params"]]
        placed = {id(p): {k: v.data_ptr() for k, v in self.state[p].items()
                          if isinstance(v, torch.Tensor)} for p in params if p in self.state}
        super().load_state_dict(state_dict)
        for p in params:
            if not state_made_elsewhere(p):
                continue
            for k, v in self.state[p].items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape \
                        and v.data_ptr() != placed.get(id(p), {}).get(k):
                    self.state[p][k] = zeros_for_state(p, k).copy_(v)

    @property
    def target(self) -> str:
        """Where the updates run: "CPU" (all parameters in host memory), "DEVICE" (all on the
        accelerator) or "CPU+DEVICE" (each update runs where its parameter lives)."""
        where = {hd.logical_name(p.device) for g in self.param_groups for p in g["params"]}
        if where == {"device"}:
            return "DEVICE"
        return "CPU+DEVICE" if len(where) > 1 else "CPU"

    def _params_with_grad(self) -> Iterable[tuple[dict[str, Any], torch.Tensor]]:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.layout not in (torch.strided, torch.sparse_coo):
                        raise TypeError(f"{type(self).__name__}: gradients must be dense or "
                                        f"sparse COO, got {p.grad.layout}")
                    yield group, p

    def _scratch_rows(self, like: torch.Tensor, count: int, rows: int) -> list[torch.Tensor]:
        """``count`` scratch tensors of ``[rows, *like.shape[1:]]`` on ``like``'s device."""
        key = (like.device, like.dtype, tuple(like.shape[1:]), count)
        buffers = self.__dict__.setdefault("_row_buffers", {})
        held = buffers.get(key)
        if held is None or held[0].shape[0] < rows:
            held = [torch.empty((rows + rows // 4, *like.shape[1:]), dtype=like.dtype,
                                device=like.device) for _ in range(count)]
            buffers[key] = held
        return [b[:rows] for b in held]

    def update_rows(self, grad: torch.Tensor, tensors: Sequence[torch.Tensor],
                    update: Callable[..., Sequence[torch.Tensor]], scratch: int = 0) -> None:
        """Apply ``update`` to the rows the sparse ``grad`` touches in ``tensors`` (the
        parameter first, then its state tensors, all of the parameter's shape).

        ``update(g, *gathered, *scratch_buffers)`` gets the gradient rows (in the parameter's
        dtype), the gathered rows of each tensor and ``scratch`` spare row buffers; it returns
        the updated rows of each tensor, in order, which are scattered back.
        """
        rows, g, row_shape = sparse_rows(grad, tensors[0])
        if rows.numel() == 0:
            return
        full = [t.view(-1, *row_shape) for t in tensors]
        parts = self._scratch_rows(full[0], len(full) + scratch, rows.numel())
        for whole, part in zip(full, parts, strict=False):
            torch.index_select(whole, 0, rows, out=part)
        updated = update(g.to(tensors[0].dtype), *parts)
        for whole, part in zip(full, updated, strict=True):
            whole.index_copy_(0, rows, part)
