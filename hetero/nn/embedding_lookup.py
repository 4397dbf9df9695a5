"""``hetero.nn.EmbeddingLookup``: an embedding table that lives on the host or on the accelerator.

The reference design's "embedding heterogeneity": tables too large for accelerator memory stay in
host memory, the lookup runs there, and only the looked-up rows cross to the accelerator; the
sparse optimizers that update them (``hetero.optim.LazyAdam``, ``FTRL``) run on the host too.
``target`` switches the whole thing, with MindSpore's ``nn.EmbeddingLookup`` argument rules:

* ``target="CPU"`` (needs ``sparse=True``): the table stays in host memory when the model is moved
  (``model.to(device)``) or ``hetero.place``d: the module declares its placement
  (``hetero_device = "cpu"``) and ``_apply`` keeps the table on the host while recording where
  the output must go (``output_device``). The lookup runs on the host over the unique indices,
  only those rows cross (pinned, non-blocking), and the gradient is row-sparse on the host
  (see :mod:`hetero.nn.host_lookup`).
* ``target="DEVICE"``: an ``nn.Embedding`` in all but name: the table follows ``.to()``, the
  lookup runs where it is, with a sparse (``sparse=True``) or dense gradient.
* ``sharding="row"``: a parameter-server table for tables beyond one host. Each rank holds one
  contiguous block of rows (``weight`` is that block) and looks rows up and pushes their
  gradients over all-to-all (:mod:`hetero.nn.row_sharded`); every rank must call the lookup each
  step, an empty batch included. With ``target="CPU"`` the blocks live in host memory and the
  rows travel over gloo; with ``target="DEVICE"`` they live in accelerator memory and travel
  over its backend (NCCL/HCCL). ``cache_size`` adds the device-side cache of the hottest rows
  (:mod:`hetero.nn.row_cache`).

Why ``_apply`` and not keeping the table out of the parameter registry: as a registered
``nn.Parameter`` it stays in ``parameters()``, ``named_parameters()`` and ``state_dict()`` under
the same name for either target, so optimizers, DDP's ignore lists, DCP checkpoints and
``hetero.place``'s tensor homes all see it with no special case. Only device moves skip it.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import foundation.device as hd
from foundation.host_storage import stay_on_host
from foundation.own_groups import own_group
from hetero.nn.host_lookup import check_index_dtype, checked_indices, host_embedding_lookup
from hetero.nn.row_blocks import block, mark_row_shard, mark_state_maker
from hetero.nn.row_cache import RowCache
from hetero.nn.row_sharded import as_block, as_global, sharded_lookup
from hetero.offload.mapped_file import MappedFile, zeros_in_file

TARGETS = ("CPU", "DEVICE")
SHARDINGS = ("none", "row")

#: ``param_init`` names, with MindSpore's initializer defaults (Normal sigma 0.01, Uniform 0.07).
PARAM_INITS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "normal": lambda t: nn.init.normal_(t, mean=0.0, std=0.01),
    "uniform": lambda t: nn.init.uniform_(t, -0.07, 0.07),
    "xavier_uniform": nn.init.xavier_uniform_,
    "zeros": nn.init.zeros_,
    "ones": nn.init.ones_,
}

ParamInit = str | torch.Tensor | Callable[[torch.Tensor], object]

# torch.compile runs the host lookup eagerly (a graph break) and compiles around it: AOTAutograd
# cannot trace its backward, whose row count depends on the data. hetero.place's capture
# (non-strict torch.export) is unaffected and keeps the op as one node. Made by the first table,
# not at import: torch.compiler.disable imports torch._dynamo (half a second in every process
# that imports the package, table or not).
_host_lookup: Callable[..., torch.Tensor] | None = None


def _compile_skipped_lookup() -> Callable[..., torch.Tensor]:
    global _host_lookup
    if _host_lookup is None:
        _host_lookup = torch.compiler.disable(host_embedding_lookup)
    return _host_lookup


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"EmbeddingLookup: {name} must be an int, got {type(value).__name__} "
                        f"{value!r}")
    if value <= 0:
        raise ValueError(f"EmbeddingLookup: {name} must be a positive int, got {value}")
    return int(value)


_CHUNK = 65536  # rows per independently seeded piece of a table's named init
_BLOCK_INITS = ("normal", "uniform", "xavier_uniform", "zeros", "ones")


def _block_init(name: str, vocab_size: int, dim: int, start: int, end: int,
                dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[start, end)`` of the table a named init makes, the same rows at any world size:
    the table is filled in fixed pieces of ``_CHUNK`` rows, each from its own generator seeded
    from one draw of the global RNG (which every rank seeds alike), so a rank generates only the
    pieces its block overlaps, never the whole table."""
    seed = int(torch.randint(0, 2**62, (1,)).item())  # drawn on every rank: the streams agree
    block = torch.empty(end - start, dim, dtype=dtype) if out is None else out
    if name in ("zeros", "ones"):
        return block.fill_(float(name == "ones"))
    bound = 0.07 if name == "uniform" else math.sqrt(6.0 / (vocab_size + dim))  # xavier: fans
    for first in range(start // _CHUNK * _CHUNK, end, _CHUNK):
        g = torch.Generator().manual_seed(seed + first // _CHUNK)
        piece = torch.empty(min(_CHUNK, vocab_size - first), dim)
        if name == "normal":
            piece.normal_(0.0, 0.01, generator=g)
        else:
            piece.uniform_(-bound, bound, generator=g)
        lo, hi = max(first, start), min(first + _CHUNK, end)
        block[lo - start:hi - start] = piece[lo - first:hi - first]
    return block


def _initial_table(vocab_size: int, dim: int, param_init: ParamInit,
                   dtype: torch.dtype, rows: tuple[int, int] | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The table, or with ``rows`` only that block of it (a tensor ``param_init`` is sliced; a
    named init gives the same rows at any world size; a callable fills just the block), made
    in ``out`` when given (a table at rest in a file: filled there, never whole in memory)."""
    start, end = rows or (0, vocab_size)
    if isinstance(param_init, torch.Tensor):
        if tuple(param_init.shape) != (vocab_size, dim):
            raise ValueError(f"EmbeddingLookup: a param_init tensor must have shape "
                             f"({vocab_size}, {dim}), got {tuple(param_init.shape)}")
        rows_given = param_init.detach()[start:end]
        return rows_given.to("cpu", dtype, copy=True) if out is None else out.copy_(rows_given)
    if isinstance(param_init, str) and param_init in _BLOCK_INITS:
        # whole or row-sharded, host or device, cached or not: one table for one seed
        return _block_init(param_init, vocab_size, dim, start, end, dtype, out)
    table = torch.empty(end - start, dim, dtype=dtype, device="cpu") if out is None else out
    if isinstance(param_init, str):
        if param_init not in PARAM_INITS:
            raise ValueError(f"EmbeddingLookup: unknown param_init {param_init!r}; choose one of "
                             f"{sorted(PARAM_INITS)}, a tensor or a callable")
        PARAM_INITS[param_init](table)
    elif callable(param_init):
        with torch.no_grad():
            param_init(table)
    else:
        raise TypeError(f"EmbeddingLookup: param_init must be a name, a tensor or a callable, "
                        f"got {type(param_init).__name__}")
    return table


class EmbeddingLookup(nn.Module):
    """Look rows of a ``[vocab_size, embedding_size]`` table up by integer index.

    Args:
        vocab_size, embedding_size: table shape (positive ints).
        param_init: "normal" (std 0.01), "uniform" (±0.07), "xavier_uniform", "zeros", "ones",
            a tensor of the table's shape, or a callable that fills the table in place.
        target: "CPU" (table and lookup on the host, rows shipped) or "DEVICE".
        sparse: row-sparse gradient (required for "CPU").
        dtype: table dtype (default float32).
        sharding: "none", or "row": rows split over the ranks of ``process_group`` (default:
            the world; needs ``parallel.init()``), each holding one block (``row_range``).
        gradients_mean: with ``sharding="row"``, divide the pushed gradients by the world size,
            as ``DataParallel(gradients_mean=True)`` does for the dense parameters.
        cache_size: with ``sharding="row"``, hold this many of the hottest rows (and their
            optimizer state) on every rank, where the lookup delivers (``.to(device)``): they
            are served without the network and trained exactly as in their owners' blocks
            (``hetero.nn.row_cache``). None: no cache.
        cache_refresh: optimizer steps between two refreshes of which rows the cache holds.
        disk_path: a directory on a local disk: the table (this rank's block of it) rests in a
            file there instead of host memory, made in the file by ``param_init``, and so does
            its sparse optimizer's state (``LazyAdam``, ``FTRL``). The kernel pages the rows a
            lookup or an update touches in and writes them back when memory is wanted: the
            page cache holds the warm rows, the disk the cold ones, ``cache_size`` the hottest
            on the device. The file is unlinked at once (nothing is left behind, however the
            process ends); a table that does not fit the disk is refused naming the bytes.
            Needs ``target="CPU"``.

    Indices may have any integer dtype and shape; the output has shape
    ``[*indices.shape, embedding_size]``. An index outside ``[0, vocab_size)`` raises IndexError
    naming it (on the accelerator that costs one host sync per call).
    """

    def __init__(self, vocab_size: int, embedding_size: int, param_init: ParamInit = "normal",
                 target: str = "CPU", sparse: bool = True,
                 dtype: torch.dtype = torch.float32, sharding: str = "none",
                 process_group: dist.ProcessGroup | None = None,
                 gradients_mean: bool = True, cache_size: int | None = None,
                 cache_refresh: int = 100, disk_path: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.vocab_size = _positive_int("vocab_size", vocab_size)
        self.embedding_size = _positive_int("embedding_size", embedding_size)
        if not isinstance(sparse, bool):
            raise TypeError(f"EmbeddingLookup: sparse must be a bool, got "
                            f"{type(sparse).__name__}")
        if target not in TARGETS:
            raise ValueError(f"EmbeddingLookup: target {target!r} is not one of 'CPU', 'DEVICE'")
        if target == "CPU" and not sparse:
            raise ValueError("EmbeddingLookup: target='CPU' needs sparse=True (a host table is "
                             "updated row by row; a dense gradient would be the whole table)")
        self.target, self.sparse = target, sparse
        if target == "CPU":
            _compile_skipped_lookup()  # made before any torch.compile traces a forward
        self.sharding, self.process_group = _check_sharding(sharding, target, sparse,
                                                            process_group)
        self.row_range = (0, self.vocab_size)
        self.grad_scale = 1.0
        #: where the row exchanges run: the table's group for state dicts, and a group of
        #: its own for the lookups, whose gradient push runs on the thread of the table's
        #: device in backward (foundation/own_groups.py)
        self.exchange_group = process_group
        if self.sharding == "row":
            world = dist.get_world_size(process_group)
            self.row_range = block(self.vocab_size, world, dist.get_rank(process_group))
            self.grad_scale = 1.0 / world if gradients_mean else 1.0
            self.exchange_group = own_group(process_group, f"EmbeddingLookup rows ({target})")
        out = None
        if disk_path is not None:
            if target != "CPU":
                raise ValueError(f"EmbeddingLookup: disk_path={str(disk_path)!r} keeps a host "
                                 f"table (target='CPU') at rest in a file; a target='DEVICE' "
                                 f"table lives on the device")
            rank = dist.get_rank() if dist.is_initialized() else 0
            name = f"embedding_lookup.rank{rank}.{os.getpid()}.{id(self)}"
            rows = self.row_range[1] - self.row_range[0]
            file = MappedFile(disk_path, f"{name}.table",
                              [(torch.Size((rows, self.embedding_size)), dtype)], random=True)
            out = file.tensors[0]
        self.weight = nn.Parameter(_initial_table(
            self.vocab_size, self.embedding_size, param_init, dtype,
            self.row_range if self.sharding == "row" else None, out))
        if out is not None:  # made in its file: its pages go back there now, not held
            file.release([0])  # resident; the optimizer's state of it rests beside it
            mark_state_maker(self.weight, functools.partial(
                _state_in_file, disk_path, name, tuple(out.shape), dtype))
        if self.sharding == "row":  # state dicts hold the whole table, as a Shard(0) DTensor
            mark_row_shard(self.weight, self.vocab_size, process_group)
            self._register_state_dict_hook(_whole_table)
            self._register_load_state_dict_pre_hook(_this_block, with_module=True)
        self.cache: RowCache | None = None
        if cache_size is not None:
            if self.sharding != "row":
                raise ValueError("EmbeddingLookup: cache_size caches the rows of a row-sharded "
                                 "table; it needs sharding='row'")
            size = _positive_int("cache_size", cache_size)
            if size > self.vocab_size:
                raise ValueError(f"EmbeddingLookup: cache_size={size} exceeds vocab_size "
                                 f"{self.vocab_size}")
            self.cache_rows = nn.Parameter(torch.zeros(size, self.embedding_size, dtype=dtype))
            self.cache = RowCache(self.cache_rows, self.weight, self.row_range, process_group,
                                  _positive_int("cache_refresh", cache_refresh))
            self.register_state_dict_pre_hook(lambda module, *_: module.cache.flush())
        #: Where a target="CPU" lookup delivers its rows: set by ``.to()``.
        self.output_device = torch.device("cpu")

    @property
    def embedding_table(self) -> nn.Parameter:
        """The table (MindSpore's name for it); the same parameter as ``weight``."""
        return self.weight

    @property
    def hetero_device(self) -> str | None:
        """The placement this module declares for ``hetero.place``: "cpu" for a host table."""
        return "cpu" if self.target == "CPU" else None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> EmbeddingLookup:
        """Device moves skip a host table (they set ``output_device``); dtype changes apply."""
        if self.target != "CPU":
            return super()._apply(fn, recurse)
        probe = fn(torch.empty(0))  # where, and in which dtype, fn puts a float32 tensor
        if probe.device.type in ("cpu", "meta"):  # host moves, meta init: the table follows
            super()._apply(fn, recurse)
            self.output_device = probe.device
            return self
        cast = probe.dtype if probe.dtype != torch.float32 else None  # .half(), .double()
        if self.weight.is_meta:  # to_empty of a meta table: host storage (host_storage.py)
            table = self.weight
            super()._apply(lambda t: stay_on_host(t, cast) if t is table else fn(t), recurse)
        else:  # the table stays out of the move; a cast applies on the host
            table = self._parameters.pop("weight")
            try:
                super()._apply(fn, recurse)
            finally:
                self._parameters["weight"] = table
            if cast is not None and table.is_floating_point():
                table.data = table.data.to(cast)
        self.output_device = probe.device
        return self

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows of ``indices``, shape ``[*indices.shape, embedding_size]``."""
        check_index_dtype(indices, "EmbeddingLookup")
        if self.sharding == "row":  # a device table's rows are delivered where it lives
            return sharded_lookup(self.weight, indices, self.vocab_size, self.exchange_group,
                                  self.grad_scale, self.weight.device
                                  if self.target == "DEVICE" else self.output_device, self.cache)
        if self.target == "DEVICE":
            # a device without sparse tensors (an NPU) gets a dense gradient: same values
            return F.embedding(checked_indices(indices, self.vocab_size), self.weight,
                               sparse=self.sparse and hd.has_sparse_tensors(self.weight.device))
        # Captured by hetero.place: the rows go to the accelerator whatever .to() said.
        to = "device" if torch.compiler.is_exporting() else str(self.output_device)
        return _compile_skipped_lookup()(self.weight, indices, to)

    def flush_cache(self) -> None:
        """Write the cached rows (and their optimizer state) back to their owners' blocks; a
        checkpoint does this itself. No-op without a cache."""
        if self.cache is not None:
            self.cache.flush()

    def cache_stats(self) -> dict[str, float]:
        """This rank's cache hit rate over the last refresh window (hits / distinct ids looked
        up) and the rows held; empty without a cache."""
        if self.cache is None:
            return {}
        return {"cache_hit_rate": self.cache.hit_rate,
                "cache_rows": int((self.cache.ids >= 0).sum())}

    def extra_repr(self) -> str:
        sharded = f", sharding='row', rows={self.row_range}" if self.sharding == "row" else ""
        if self.cache is not None:
            sharded += f", cache_size={self.cache.ids.numel()}"
        return (f"vocab_size={self.vocab_size}, embedding_size={self.embedding_size}, "
                f"target={self.target!r}, sparse={self.sparse}{sharded}")


def _whole_table(module: EmbeddingLookup, state: dict, prefix: str, _meta: object) -> None:
    """The block as the whole table; a cache's rows are left out (written back by then), so a
    checkpoint resumes with or without a cache, at any world size."""
    key = prefix + "weight"
    if key in state:
        state[key] = as_global(state[key], module.vocab_size, module.process_group)
    state.pop(prefix + "cache_rows", None)


def _this_block(module: EmbeddingLookup, state: dict, prefix: str, *_: object) -> None:
    key = prefix + "weight"
    if key in state:
        state[key] = as_block(state[key])
    if module.cache is not None:  # the loaded blocks hold the truth: the cache starts empty
        module.cache.clear()
        state.setdefault(prefix + "cache_rows", module.cache_rows.detach())


def _state_in_file(directory: str | os.PathLike, table: str, shape: tuple[int, ...],
                   dtype: torch.dtype, name: str) -> torch.Tensor:
    """The optimizer state ``name`` of a table at rest in a file: zeros in a file beside it."""
    return zeros_in_file(directory, f"{table}.{name}", shape, dtype, random=True)


def _check_sharding(sharding: str, target: str, sparse: bool, group: dist.ProcessGroup | None
                    ) -> tuple[str, dist.ProcessGroup | None]:
    if sharding not in SHARDINGS:
        raise ValueError(f"EmbeddingLookup: sharding {sharding!r} is not one of {SHARDINGS}")
    if sharding == "none":
        if group is not None:
            raise ValueError("EmbeddingLookup: process_group applies to sharding='row' only")
        return sharding, None
    if not sparse:
        raise ValueError("EmbeddingLookup: sharding='row' needs sparse=True (its gradient is "
                         "pushed to the rows' owners row by row)")
    if not dist.is_initialized():
        raise ValueError("EmbeddingLookup: sharding='row' splits the table over the ranks of a "
                         "process group, and there is none: call parallel.init() first")
    return sharding, group
