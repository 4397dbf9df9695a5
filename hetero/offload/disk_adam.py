"""``DiskAdamW``: AdamW whose FP32 master weights and moments live on disk (ZeRO-Infinity's NVMe
optimizer state), streamed a chunk at a time.

The model keeps computing with its parameters (any device, any float dtype). The optimizer keeps
nothing per parameter in memory: every group's parameters are laid end to end in one flat space,
cut into chunks of ``chunk_mb``, and each chunk's master weights, first and second moments are
kept in a scratch file (:class:`~hetero.offload.disk_file.ChunkFile`, one plane each). A step
runs down
the chunks with four reused host buffers: chunks i+1 and i+2 are being read (queued on the
reader thread) while chunk i is updated and chunk i-1 is being written, so each byte of state
crosses the disk once each way per step and the disk stays busy. Host memory holds the four
buffers and one chunk of gradients, whatever the model's size.

The update of a chunk is torch's fused AdamW (``foundation.compat.fused_adam_``, the kernel of
``torch.optim.AdamW(fused=True)``) over each run of the chunk's parameters that have gradients
and the same step count, so a chunk boundary inside a parameter changes no value: on FP32
parameters the result is torch's fused AdamW's, bit for bit. The updated master is then written
into each parameter (cast to its dtype, copied to its device).

Under optimizer parallel (level1-3) or any other layout whose parameters are ``DTensor`` shards or
replicas, each rank's state is its local part's: a rank's file holds the master and moments of
its own rows only, and the update is the same elementwise one.

The file keeps each kind of state in its own region (the chunk file's three planes), so every
parameter's master and moments are contiguous arrays in it. ``state_dict()`` returns those
arrays as tensors over a memory map of the file (``DTensor`` s over them for sharded parameters),
with ``torch.optim.AdamW``'s layout plus ``"fp32_master"``: a checkpoint (DCP) reads the state
from the file and writes it back in place, one tensor at a time through the page cache, and a
state never needs the memory it occupies on disk. Between state dicts ``self.state`` holds each
parameter's step count only. ``load_state_dict`` takes one from ``torch.optim.AdamW``,
``hetero.optim.OffloadAdamW`` or itself (copying only what is not already in place), so a run
resumes across the tiers.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from foundation.compat import fused_adam_
from hetero.local_parts import local
from hetero.offload.disk_file import ALIGN, ChunkFile, aligned_empty
from hetero.offload.mapped_file import release_pages

_STATE = 3  # master, exp_avg, exp_avg_sq: one chunk's three arrays (the file's three planes)
#: what ``self.state`` says of the tensors on disk between state dicts (``_mark``)
_PLACEHOLDERS = {"exp_avg": torch.empty(0), "exp_avg_sq": torch.empty(0),
                 "fp32_master": torch.empty(0)}
#: chunk buffers: one updated, one being written, READ_AHEAD being read (queued on the reader)
BUFFERS = 4
READ_AHEAD = BUFFERS - 2
PREFIX = "disk_adamw"  # the state files' names: PREFIX.rank<r>.group<g>.<pid>.<id>.bin


def _layout(numel: int, per_chunk: int) -> tuple[int, int]:
    """(elements per chunk, chunks) of a flat space of ``numel`` elements: chunks of
    ``per_chunk``, or one aligned chunk for a space smaller than that."""
    chunk = min(per_chunk, -(-max(numel, 1) // ALIGN) * ALIGN)
    return chunk, -(-max(numel, 1) // chunk)


def remove_stale(directory: Path, rank: str) -> list[Path]:
    """Remove this rank's state files left by a run that was killed (its process is gone) and
    return them; a file of a process still running (another run's) is never touched."""
    removed = []
    for path in directory.glob(f"{PREFIX}.rank{rank}.group*.bin"):
        parts = path.name.split(".")
        if len(parts) != 6 or not parts[3].isdigit():
            continue  # not a name this class writes
        pid = int(parts[3])
        if pid == os.getpid() or _alive(pid):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _check(p: torch.Tensor, group: int) -> None:
    """Refuse by name a parameter whose state cannot be laid out flat per rank."""
    if isinstance(p, DTensor) and any(not (pl.is_shard() or pl.is_replicate())
                                      for pl in p.placements):
        raise ValueError(f"DiskAdamW: param group {group} holds a DTensor with placements "
                         f"{p.placements}; it updates sharded or replicated parameters, not "
                         f"partial sums")
    part = local(p)
    if type(part.data) is not torch.Tensor:
        raise ValueError(f"DiskAdamW: param group {group} holds a {type(part.data).__name__} "
                         f"parameter; the disk state is laid out for plain tensors (or the "
                         f"local parts of DTensors)")
    if not part.is_floating_point() or part.is_sparse or not part.is_contiguous():
        raise ValueError(f"DiskAdamW: param group {group} holds a {part.dtype} tensor of layout "
                         f"{part.layout}, contiguous {part.is_contiguous()}; it updates dense, "
                         f"contiguous floating-point parameters")


@dataclasses.dataclass(eq=False)
class _Segment:
    """One parameter's place in its group's flat space: elements [start, start + numel) (of
    its local part, for a ``DTensor``)."""

    param: torch.nn.Parameter
    start: int
    step: int = 0

    @property
    def tensor(self) -> torch.Tensor:
        """The weights this rank updates: the parameter's local part, detached."""
        return local(self.param).detach()

    @property
    def grad(self) -> torch.Tensor | None:
        grad = self.param.grad
        return None if grad is None else local(grad).detach()


@dataclasses.dataclass(eq=False)
class _Space:
    """A param group laid out flat, and the file holding its state."""

    segments: list[_Segment]
    numel: int
    chunk: int  # elements per chunk
    file: ChunkFile

    @property
    def chunks(self) -> int:
        return -(-self.numel // self.chunk)


class DiskAdamW(torch.optim.Optimizer):
    """AdamW with its state on disk (module docstring).

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        path: the directory for the state files (one per group and rank, created new, removed
            when the optimizer is closed or collected).
        chunk_mb: the state bytes (master and both moments) per chunk; host memory holds
            ``BUFFERS`` (4) chunks and one chunk of gradients.
        direct: ``O_DIRECT`` IO, bypassing the page cache (falls back where the file system
            lacks it: :attr:`direct` says which ran).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, path: str | os.PathLike,
                 chunk_mb: float = 64.0, direct: bool = True) -> None:
        if not isinstance(chunk_mb, (int, float)) or isinstance(chunk_mb, bool) or chunk_mb <= 0:
            raise ValueError(f"DiskAdamW: chunk_mb must be a number > 0, got {chunk_mb!r}")
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"DiskAdamW: path {str(directory)!r} is not a directory")
        # torch.optim.AdamW's group keys too, saying what runs (its fused kernel), so a state
        # dict resumed by torch's AdamW picks the same kernel and the same bits
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=False, foreach=None, capturable=False,
                        differentiable=False, fused=True, decoupled_weight_decay=True)
        super().__init__(params, defaults)
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                _check(p, index)
        per_chunk = max(ALIGN, int(chunk_mb * 2**20) // (_STATE * 4) // ALIGN * ALIGN)
        rank = os.environ.get("RANK", "0")
        remove_stale(directory, rank)
        self._check_space(directory, per_chunk)
        self._spaces: list[_Space] = []
        try:
            for index, group in enumerate(self.param_groups):
                self._spaces.append(self._space(group["params"], directory / (
                    f"{PREFIX}.rank{rank}.group{index}.{os.getpid()}.{id(self)}.bin"),
                    per_chunk, direct))
            largest = max(space.chunk for space in self._spaces)  # a small model: small
            self._buffers = [aligned_empty(_STATE * largest) for _ in range(BUFFERS)]
            self._grads = torch.empty(largest, dtype=torch.float32)
            for space in self._spaces:
                self._seed(space)
        except BaseException:
            self.close()
            raise
        self._mark()

    def _mark(self) -> None:
        """``self.state`` holds each parameter's step count and an empty placeholder for each
        tensor on disk. Never empty, so torch's ``get_state_dict`` / ``set_state_dict`` (DCP) do
        not run their "initialise the state" step with zero gradients on it; every key there,
        because DCP's flattened loading reads a parameter's state keys from
        ``optimizer.state``."""
        self.state = collections.defaultdict(dict, {
            seg.param: {"step": torch.tensor(float(seg.step)), **_PLACEHOLDERS}
            for space in self._spaces for seg in space.segments})

    def _check_space(self, directory: Path, per_chunk: int) -> None:
        """Refuse, naming the path and both numbers, a directory without room for the state."""
        need = 0
        for group in self.param_groups:
            chunk, chunks = _layout(sum(local(p).numel() for p in group["params"]), per_chunk)
            need += chunks * chunk * _STATE * 4
        free = shutil.disk_usage(directory).free
        if need > free:
            raise ValueError(f"DiskAdamW: {directory} has {free} bytes free, and the optimizer "
                             f"state needs {need} (FP32 master and both moments: 12 B per "
                             f"parameter); free space there or choose another path")

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _space(params: list[torch.nn.Parameter], path: Path, per_chunk: int, direct: bool
               ) -> _Space:
        segments, start = [], 0
        for p in params:
            segments.append(_Segment(p, start))
            start += local(p).numel()
        chunk, chunks = _layout(start, per_chunk)
        return _Space(segments, start, chunk,
                      ChunkFile(path, chunks, _STATE * chunk * 4, direct=direct, planes=_STATE))

    @property
    def direct(self) -> bool:
        """Whether the state files use direct IO."""
        return all(space.file.direct for space in self._spaces)

    def _overlaps(self, space: _Space, index: int
                  ) -> Iterable[tuple[_Segment, slice, slice]]:
        """(segment, its elements in the chunk, the chunk's elements) for each parameter that
        chunk ``index`` holds part of."""
        a, b = index * space.chunk, min((index + 1) * space.chunk, space.numel)
        for seg in space.segments:
            lo, hi = max(a, seg.start), min(b, seg.start + seg.tensor.numel())
            if lo < hi:
                yield seg, slice(lo - seg.start, hi - seg.start), slice(lo - a, hi - a)

    def _views(self, buffer: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
        return tuple(buffer[i * chunk:(i + 1) * chunk] for i in range(_STATE))

    @torch.no_grad()
    def _seed(self, space: _Space) -> None:
        """Write every chunk's master (the parameters' values) and zero moments."""
        buffer = self._buffers[0][:_STATE * space.chunk]
        for index in range(space.chunks):
            buffer.zero_()
            master, _, _ = self._views(buffer, space.chunk)
            for seg, mine, there in self._overlaps(space, index):
                weights = seg.tensor.reshape(-1)[mine]
                master[there].copy_(weights)
                release_pages(weights)  # weights on disk: read once, not kept paged in
            space.file.write(index, buffer).result()

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update, the state streamed from disk and back (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, space in zip(self.param_groups, self._spaces, strict=True):
            space.file.unmap_pages()  # a state dict's pages: written back, let go
            stepped = {id(seg) for seg in space.segments if seg.grad is not None}
            for seg in space.segments:
                seg.step += id(seg) in stepped
            self._stream(group, space, stepped, self._chunk_update)
            for seg in space.segments:  # what the kernel's fault-around mapped back meanwhile
                release_pages(seg.tensor)
                if (grad := seg.grad) is not None:
                    release_pages(grad)
        self._mark()
        return loss

    def _stream(self, group: dict, space: _Space, stepped: set[int],
                work: Callable[[dict, _Space, int, torch.Tensor, set[int]], bool]) -> None:
        """Run ``work`` on every chunk in turn while the next ``READ_AHEAD`` chunks are read and
        the previous one written (``work`` returns whether the chunk changed and must be
        written). Reads are queued ahead, not issued one per chunk: the reader thread goes from
        one read straight to the next instead of idling until the update of the chunk before
        ends."""
        size = _STATE * space.chunk
        buffers = [b[:size] for b in self._buffers]
        reads: dict[int, Any] = {}
        writes: dict[int, Any] = {}
        for index in range(space.chunks):
            for ahead in range(index + len(reads), min(index + READ_AHEAD, space.chunks - 1) + 1):
                if ahead - BUFFERS in writes:  # its buffer is still being written out
                    writes.pop(ahead - BUFFERS).result()
                reads[ahead] = space.file.read(ahead, buffers[ahead % BUFFERS])
            reads.pop(index).result()
            if work(group, space, index, buffers[index % BUFFERS], stepped):
                writes[index] = space.file.write(index, buffers[index % BUFFERS])
        for pending in writes.values():
            pending.result()

    def _chunk_update(self, group: dict, space: _Space, index: int, buffer: torch.Tensor,
                      stepped: set[int]) -> bool:
        master, exp_avg, exp_avg_sq = self._views(buffer, space.chunk)
        runs: list[tuple[int, int, int]] = []  # chunk elements [a, b) at one step count
        for seg, mine, there in self._overlaps(space, index):
            if id(seg) not in stepped:
                continue
            grad = seg.grad
            assert grad is not None  # stepped: it had one when the step began
            self._grads[there].copy_(grad.reshape(-1)[mine])  # to host, to FP32
            if runs and runs[-1][1] == there.start and runs[-1][2] == seg.step:
                runs[-1] = (runs[-1][0], there.stop, seg.step)
            else:
                runs.append((there.start, there.stop, seg.step))
        if not runs:
            return False
        beta1, beta2 = group["betas"]
        for a, b, step in runs:
            fused_adam_(master[a:b], self._grads[a:b], exp_avg[a:b], exp_avg_sq[a:b], step,
                        lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], decoupled=True)
        for seg, mine, there in self._overlaps(space, index):
            if id(seg) in stepped:
                written = seg.tensor.reshape(-1)[mine]
                written.copy_(master[there])
                release_pages(written)  # weights and gradients on disk: their pages go now
                if (grad := seg.grad) is not None:
                    release_pages(grad.reshape(-1)[mine])
        return True

    # ------------------------------------------------------------------ state
    def _in_file(self, space: _Space) -> dict[int, tuple[torch.Tensor, ...]]:
        """Each parameter's master, exp_avg and exp_avg_sq: its arrays in the file, mapped."""
        return {id(seg): tuple(space.file.plane(k, torch.float32, seg.start, seg.tensor.numel())
                               .view(seg.tensor.shape) for k in range(_STATE))
                for seg in space.segments}

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s layout plus ``"fp32_master"`` per parameter, each tensor
        the state's own array in the file (mapped; module docstring), a ``DTensor`` over it
        for a ``DTensor`` parameter."""
        whole: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for space in self._spaces:
            arrays = self._in_file(space)
            for seg in space.segments:  # every parameter, stepped or not: DCP loads into
                state = dict(zip(("fp32_master", "exp_avg", "exp_avg_sq"),  # this layout
                                 arrays[id(seg)], strict=True))
                p = seg.param
                if isinstance(p, DTensor):  # the local part of a sharded parameter: which
                    state = {k: DTensor.from_local(v, p.device_mesh, p.placements,
                                                   shape=p.shape, stride=p.stride(),
                                                   run_check=False) for k, v in state.items()}
                whole[p] = {"step": torch.tensor(float(seg.step)), **state}
        marks, self.state = self.state, collections.defaultdict(dict, whole)
        try:
            return super().state_dict()
        finally:
            self.state = marks  # the state lives on disk; those were windows onto it

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ``torch.optim.AdamW`` / ``OffloadAdamW`` / this class: the
        hyperparameters into the groups, the tensors onto disk (those a checkpoint loaded in
        place, into :meth:`state_dict`'s arrays, are there already)."""
        saved = state_dict["state"]
        ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        # torch's load would cast every state tensor to its parameter's dtype (a 16-bit
        # parameter's FP32 master with it): the groups through torch, the tensors here
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        ours = [p for group in self.param_groups for p in group["params"]]
        by_param = {id(p): saved.get(pid, {}) for p, pid in zip(ours, ids, strict=True)}
        for group, space in zip(self.param_groups, self._spaces, strict=True):
            arrays = self._in_file(space)
            sources: dict[int, list[torch.Tensor | None]] = {}  # None: a fresh (zero) moment
            for seg in space.segments:
                entry = by_param[id(seg.param)]
                seg.step = int(entry.get("step", 0))
                sources[id(seg)] = [local(entry.get("fp32_master", seg.param)).detach(),
                                    *(local(entry[k]).detach() if k in entry else None
                                      for k in ("exp_avg", "exp_avg_sq"))]
                for source in sources[id(seg)]:
                    if source is not None and source.numel() != seg.tensor.numel():
                        raise ValueError(f"DiskAdamW.load_state_dict: a state tensor of "
                                         f"{source.numel()} elements for a parameter of "
                                         f"{seg.tensor.numel()} (this rank's part)")
            in_place = all(source is not None and source.data_ptr() == mine.data_ptr()
                           for seg in space.segments for source, mine in
                           zip(sources[id(seg)], arrays[id(seg)], strict=True))
            del arrays
            space.file.unmap_pages()  # what a checkpoint loaded in place: in the file now
            if in_place:
                continue  # a checkpoint loaded every array where it lives: nothing to copy

            def put(_g: dict, sp: _Space, index: int, buffer: torch.Tensor, _s: set,
                    sources: dict = sources) -> bool:
                views = self._views(buffer, sp.chunk)
                for seg, mine, there in self._overlaps(sp, index):
                    for view, source in zip(views, sources[id(seg)], strict=True):
                        if source is None:
                            view[there].zero_()
                        else:  # (an array loaded in place copies onto itself: its file)
                            view[there].copy_(source.reshape(-1)[mine])
                return True

            self._stream(group, space, set(), put)
        self._mark()

    def close(self) -> None:
        """Remove the state files (the optimizer cannot step after this)."""
        for space in getattr(self, "_spaces", []):
            space.file.close()
