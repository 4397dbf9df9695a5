"""Signature checks: every rank learns what the others are about to exchange, before data moves.

Why by hand: a collective whose ranks pass different shapes is the worst failure there is. gloo
either returns on every rank with different-shaped results (same element count) or kills one
rank with a C++ ``terminate`` and leaves the other with uninitialised memory. torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wrapper (``ProcessGroupWrapper``) fingerprints the list-style
collectives, but the ``*_into_tensor``/functional ones (``_ALLGATHER_BASE``) still abort in torch
2.13, and its text names two ranks at a time. So every collective this project issues first calls
:func:`check`, which all-gathers one fixed-size int64 signature (collective name, what issued it,
dtype, shape, parameters such as the reduce op or the source rank; over the group's host backend
where it has one, so no device value is read back) and raises
:class:`~foundation.errors.CollectiveError` on every rank naming each rank's call, when any differ.

Two modes:

* **check mode** (``$HETERO_PARALLEL_CHECK_COLLECTIVES=1`` or ``parallel.init(check_collectives=
  True)``): every call exchanges its signature (one small all-gather per collective: a debugging
  mode);
* **default**: the public ``parallel.*`` collectives (``public=True``) exchange a signature the
  first time it appears in a group and cache it, so a training loop's steady state costs one set
  lookup per call. Ranks that ran the same collectives hold the same cache, so a signature new to
  all of them is checked on all of them. A rank repeating a signature it has already agreed on,
  while another rank brings a new one, is not seen in this mode (the first would need to
  communicate to learn it); check mode catches that too.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from foundation import device as hd
from foundation.errors import CollectiveError

CHECK_ENV = "HETERO_PARALLEL_CHECK_COLLECTIVES"
_MAX_DIMS = 8
_MAX_PARAMS = 4
_NAME_WORDS = 3  # 24 ASCII bytes of the collective's short name ("all_to_all_rows", ...)
_MAGIC = 0x5347  # "SG": a signature, not stray memory
# [magic, name x3, what-crc, dtype, ndim, numel, dims x8, params x4]
_LEN = 1 + _NAME_WORDS + 1 + 1 + 1 + 1 + _MAX_DIMS + _MAX_PARAMS
_ANY = -1  # a dimension that may differ between ranks (the row count of a variable all_to_all)
_CACHE_LIMIT = 4096  # signatures kept per group; all ranks clear at the same call

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}

_enabled: bool | None = None  # None: read $HETERO_PARALLEL_CHECK_COLLECTIVES on first use
_seen: dict[str, set[tuple]] = {}  # group name -> signatures all ranks agreed on


def set_enabled(on: bool | None) -> None:
    """Turn check mode on or off (None: follow ``$HETERO_PARALLEL_CHECK_COLLECTIVES``); clears
    the default mode's cache, as a new process group starts a new history."""
    global _enabled
    _enabled = on
    _seen.clear()


def enabled() -> bool:
    """Whether every collective exchanges its signature first."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get(CHECK_ENV, "0") not in ("", "0")
    return _enabled


def _group_name(group: dist.ProcessGroup | None) -> str:
    group = group if group is not None else dist.group.WORLD
    return getattr(group, "group_name", None) or str(id(group))


def check(name: str, tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
          what: str | None = None, params: Sequence[int] = (), free_dims: Sequence[int] = (),
          public: bool = False, shape: Sequence[int] | None = None) -> None:
    """Raise :class:`CollectiveError` on every rank of ``group`` if the ranks are not all about
    to run ``name`` on a tensor of this dtype and shape with these ``params``.

    ``name`` is the collective ("all_reduce"); ``what`` what issues it (default ``name``; it is
    part of the signature, so it must read the same on every rank that joins the call);
    ``params`` small integers that must agree (reduce op, source rank); ``free_dims`` dimensions
    that may differ between ranks; ``shape`` the shape to compare when it is not ``tensor``'s (a
    DTensor's global shape). Checks every call in check mode; in the default mode only
    ``public`` calls with a signature new to this group, once.
    """
    if not dist.is_initialized():
        return
    seen: set[tuple] | None = None
    if not (_enabled if _enabled is not None else enabled()):
        if not public:
            return
        # the steady state of the default mode: one tuple and one set lookup. A free dimension
        # (a variable all_to_all's row count) differs between ranks by design, so it is not part
        # of the key: with it, one rank could find a row count cached while another checks a new
        # one, and the first would run the collective against the second's check (a hang)
        dims = tuple(tensor.shape) if shape is None else tuple(shape)
        if free_dims:
            dims = tuple(_ANY if i in free_dims or i - len(dims) in free_dims else n
                         for i, n in enumerate(dims))
        key = (name, what, tensor.dtype, dims, params, free_dims)
        seen = _seen.get("" if group is None else _group_name(group))
        if seen is None:
            seen = _seen.setdefault("" if group is None else _group_name(group), set())
        elif key in seen:
            return
    if not dist.is_initialized():
        return
    world = dist.get_world_size(group)
    if world == 1:
        if seen is not None:
            seen.add(key)
        return
    mine = _encode(name, what or name, tensor, params, free_dims,
                   tuple(tensor.shape) if shape is None else tuple(shape))
    # over the host backend where the group has one: no device value is read back
    mine = mine.to("cpu" if hd.has_host_backend(group) else tensor.device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    rows = [row.tolist() for row in everyone]
    if any(row != rows[0] for row in rows):
        raise CollectiveError(_message(what or name, rows, group))
    if seen is not None:  # only agreed signatures: the ranks' caches stay equal after an error
        if len(seen) >= _CACHE_LIMIT:
            seen.clear()
        seen.add(key)


def check_splits(name: str, send: Sequence[int], recv: Sequence[int],
                 group: dist.ProcessGroup | None = None, *, what: str | None = None) -> None:
    """After :func:`check` agreed on a variable-split all_to_all: raise on every rank unless the
    rows each rank sends to each other rank are the rows that rank expects (check mode only)."""
    if not (dist.is_initialized() and enabled()):
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([*send, *recv], dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    table = [row.tolist() for row in everyone]
    ranks = _global_ranks(group, world)
    wrong = [f"rank {ranks[a]} sends {table[a][b]} rows to rank {ranks[b]}, which expects "
             f"{table[b][world + a]}"
             for a in range(world) for b in range(world) if table[a][b] != table[b][world + a]]
    if wrong:
        raise CollectiveError(f"{what or name}: the ranks disagree on the split sizes (caught "
                              f"before any data moved): " + "; ".join(wrong))


def _encode(name: str, what: str, tensor: torch.Tensor, params: Sequence[int],
            free_dims: Sequence[int], full: tuple[int, ...]) -> torch.Tensor:
    if len(params) > _MAX_PARAMS:
        raise ValueError(f"a collective signature holds at most {_MAX_PARAMS} parameters")
    shape = [(_ANY if d in free_dims else s) for d, s in enumerate(full)]
    if len(shape) > _MAX_DIMS:  # fold the trailing dimensions: their product still must agree
        tail = 1
        for s in shape[_MAX_DIMS - 1:]:
            tail *= s
        shape = shape[:_MAX_DIMS - 1] + [tail]
    raw = name.encode("ascii")[:8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b"\0")
    words = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
    numel = _ANY if free_dims else math.prod(full)
    row = [_MAGIC, *words, zlib.crc32(what.encode()), _DTYPE_CODE.get(tensor.dtype, 99),
           len(full), numel, *shape, *[-2] * (_MAX_DIMS - len(shape)),
           *params, *[0] * (_MAX_PARAMS - len(params))]
    return torch.tensor(row, dtype=torch.int64)



def _describe(row: list[int]) -> str:
    if row[0] != _MAGIC:
        return "something other than a checked collective"
    raw = b"".join(w.to_bytes(8, "little") for w in row[1:1 + _NAME_WORDS]).rstrip(b"\0")
    at = 1 + _NAME_WORDS + 1
    code, ndim = row[at], row[at + 1]
    dims = row[at + 3:at + 3 + min(ndim, _MAX_DIMS)]
    shape = "[" + ", ".join("*" if d == _ANY else str(d) for d in dims) + "]"
    dtype = str(_DTYPES[code]).removeprefix("torch.") if code < len(_DTYPES) else "?"
    params = row[at + 3 + _MAX_DIMS:]
    extra = f" params {params}" if any(params) else ""
    return f"{raw.decode('ascii', 'replace')} {dtype} {shape}{extra}"


def _global_ranks(group: dist.ProcessGroup | None, world: int) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(range(world))
    return list(dist.get_process_group_ranks(group))


def _message(what: str, rows: list[list[int]], group: dist.ProcessGroup | None) -> str:
    ranks = _global_ranks(group, len(rows))
    calls: dict[str, list[int]] = {}
    for rank, row in zip(ranks, rows, strict=True):
        calls.setdefault(_describe(row), []).append(rank)
    if len(calls) == 1:  # same collective, shape and dtype: issued from different places
        listing = "the same call issued from different places in the code"
    else:
        listing = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                        for text, r in calls.items())
    differ = [r for r, row in zip(ranks, rows, strict=True) if row != rows[0]]
    me = dist.get_rank()
    return (f"{what}: the ranks called mismatched collectives (caught on rank {me} before any "
            f"data moved): {listing}. Ranks {differ} differ from rank {ranks[0]}.")
