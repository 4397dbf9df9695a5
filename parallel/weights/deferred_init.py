"""Deferred initialization: a model built on the meta device gets storage and values only for
what this rank holds, after ``parallelize`` has split and sharded it.

``with torch.device("meta"): model = Net()`` builds every parameter and buffer without storage.
``parallel.parallelize`` records (:func:`defer`), before any step changes the model, each
tensor's *canonical* name — the first name it has in ``named_parameters(remove_duplicate=False)``,
so a tied alias such as ``lm_head.weight`` is generated as ``tok_emb.weight`` — and keeps an
untouched meta twin of the whole model. The modes then split (pipeline stages keep their original
names) and shard (expert ``Shard(0)`` DTensors, FSDP2's ``Shard(0)`` under optimizer parallel)
using only shapes, and the first step that needs values calls :func:`materialize_pending`:

1. ``to_empty`` on the rank's roots gives storage to what the rank holds — only its stages, only
   its shards (FSDP2 re-pads its shards itself in ``_apply``); semi-auto and auto parallel
   allocate each DTensor's block themselves when they build it
   (``parallel.weights.deferred_spmd``), so nothing is meta there any more and this step is skipped;
2. per tensor, its FULL value is generated on the host (one tensor at a time, so the peak is the
   rank's share plus one tensor) from a CPU generator forked and seeded by ``(seed, name)``
   through a stable hash — ``model.init_parameter(name, tensor)`` when the model defines it, else
   the owning module's ``reset_parameters()`` run on the twin's module given host storage (seeded
   by ``(seed, module path)``: one call fills the module's tensors together);
3. the rank's block of it (a whole tensor, or a DTensor's shard by its global offset) is copied
   into the storage.

With a weights source (``parallelize(..., weights=path)``, ``materialize(..., weights=path)``),
step 2 and 3 read the rank's block of each tensor the file holds straight from the file instead
(``parallel.weights.files``: safetensors ``get_slice`` of the block, or DCP reading the rank's
chunks); the names and global shapes are checked against the whole model when it is recorded,
before any step changes it (``parallel.weights.match``). Buffers already real in the meta model
(HF's rotary ``inv_freq``: non-persistent, computed in ``__init__``) are kept as they are.

So every rank's values are bitwise the same slices as ``parallel.materialize(model, seed=...)``
gives the whole model in one process — on any number of ranks, in any layout — and no collective
is needed to make replicas agree (the data-parallel wrappers skip their rank-0 broadcast for a
model materialized here). Generating the whole tensor and slicing it (rather than DTensor's
offset-based RNG) is what makes the values independent of the layout; it costs one full tensor
of host memory at a time.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import foundation.device as hd
from foundation.compat import dtensor_slice
from parallel.weights.deferred_hooks import keeping_hooks
from parallel.weights.loading import fill_held
from parallel.weights.match import Weights, match_weights


class Split(NamedTuple):
    """A tensor the model's own code cut (hybrid parallel's ``mark_model_parallel(dim=)``):
    this rank holds slice ``index`` of ``parts`` equal ones along ``dim`` of the whole tensor."""

    dim: int
    index: int
    parts: int


@dataclasses.dataclass
class DeferredInit:
    """What :func:`defer` records of a meta model before any parallel step changes it."""

    seed: int
    device: torch.device
    #: every name a parameter or buffer has (tied aliases included) -> its canonical name
    canonical: dict[str, str]
    #: the whole model as it was given, on the meta device (owners for ``reset_parameters``)
    twin: nn.Module
    #: the weights file matched to the model's names (None: every value from ``seed``)
    weights: Weights | None = None
    #: canonical name -> the slice of the whole tensor this rank's tensor is (hybrid parallel)
    splits: dict[str, Split] = dataclasses.field(default_factory=dict)


#: where full values are generated: the host, so they are the same whatever the accelerator
HOST = hd.resolve("cpu")
_PENDING: weakref.WeakKeyDictionary[nn.Module, DeferredInit] = weakref.WeakKeyDictionary()


def _tensors(model: nn.Module, remove_duplicate: bool = True
             ) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=remove_duplicate)
    yield from model.named_buffers(remove_duplicate=remove_duplicate)


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for _, t in _tensors(model))


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter/buffer name of ``model`` -> the first name of the same tensor."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(t), name) for name, t in _tensors(model, False)}


def stable_seed(seed: int, name: str) -> int:
    """A generator seed from ``(seed, name)``, the same in every process and Python version
    (``hash()`` of a string is salted per process)."""
    digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _owner(model: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return path, model.get_submodule(path), leaf


def seeded(model: nn.Module, covered: frozenset[str] | set[str]) -> set[str]:
    """Canonical names of ``model`` whose values deferred initialization generates from the
    seed: neither ``covered`` (by a weights file) nor a buffer given real."""
    kept = {n for n, t in model.named_buffers() if not t.is_meta}
    return set(canonical_names(model).values()) - set(covered) - kept


def check_initializable(model: nn.Module, covered: frozenset[str] | set[str] = frozenset()
                        ) -> None:
    """ValueError naming the first tensor of ``model`` that deferred initialization could not
    fill: the model defines no ``init_parameter(name, tensor)``, and its owning module has no
    ``reset_parameters()``; or a parameter is already real (the model must be meta throughout;
    a real buffer is kept as it is). ``covered``: canonical names a weights file fills."""
    real = next((n for n, t in model.named_parameters() if not t.is_meta), None)
    if real is not None:
        raise ValueError(f"deferred initialization: '{real}' is not on the meta device; build the "
                         f"whole model under torch.device('meta') (or none of it)")
    if callable(getattr(model, "init_parameter", None)):
        return
    buffers = {n for n, _ in model.named_buffers()}
    for name in sorted(seeded(model, covered)):
        path, owner, _ = _owner(model, name)
        if name in buffers:  # reset_parameters() need not reset buffers: no way to tell
            raise ValueError(
                f"deferred initialization: buffer '{name}' has no initializer: the model "
                f"({type(model).__name__}) defines no init_parameter(name, tensor), which "
                f"deferred initialization calls for buffers; define one, or build the model on "
                f"a real device")
        if not callable(getattr(owner, "reset_parameters", None)):
            raise ValueError(
                f"deferred initialization: '{name}' has no initializer: its module "
                f"'{path or '<model>'}' ({type(owner).__name__}) has no reset_parameters() and "
                f"the model ({type(model).__name__}) no init_parameter(name, tensor); define "
                f"one, or build the model on a real device")


def _record(model: nn.Module, seed: int, device: torch.device | str | None,
            weights: Weights | None = None, splits: dict[str, Split] | None = None
            ) -> DeferredInit:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"deferred initialization: seed must be a non-negative int, got {seed!r}")
    check_initializable(model, set(weights.keys) if weights is not None else set())
    try:  # a meta model copies without storage
        twin = copy.deepcopy(model, _shared_handles(model))
    except Exception as err:
        raise ValueError(f"deferred initialization: the meta model ({type(model).__name__}) "
                         f"cannot be copied to keep its untouched twin: {err}") from err
    for name, split in (splits or {}).items():
        _widen(twin, name, split)
    return DeferredInit(seed, hd.resolve("device" if device is None else device),
                        canonical_names(model), twin, weights, dict(splits or {}))


def _shared_handles(model: nn.Module) -> dict[int, object]:
    """A ``deepcopy`` memo that makes the twin share ``model``'s process groups and device
    meshes (a hybrid model's layers keep their ``mp`` group): they cannot be copied, and the twin
    only generates values, it never runs."""
    handles = (dist.ProcessGroup, DeviceMesh)
    return {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, handles)}


def _widen(twin: nn.Module, name: str, split: Split) -> None:
    """Give the twin's tensor ``name`` the whole tensor's shape (``parts`` slices along ``dim``),
    still on the meta device: ``reset_parameters`` (which reads sizes from its tensors, as
    torch's modules do) and ``init_parameter`` then generate the whole value the one-process
    model holds, and the rank keeps its slice of it."""
    _, owner, leaf = _owner(twin, name)
    meta = getattr(owner, leaf)
    shape = list(meta.shape)
    shape[split.dim] *= split.parts
    whole = torch.empty(shape, dtype=meta.dtype, device="meta")
    if isinstance(meta, nn.Parameter):
        setattr(owner, leaf, nn.Parameter(whole, requires_grad=meta.requires_grad))
    else:
        owner.register_buffer(leaf, whole, persistent=leaf not in
                              owner._non_persistent_buffers_set)


def defer(model: nn.Module, seed: int, device: torch.device | str | None = None,
          weights: Weights | None = None, splits: dict[str, Split] | None = None) -> None:
    """Record ``model`` (its parameters on the meta device) for :func:`materialize_pending`,
    before any parallel step changes it; raises first if it could not be initialized.
    ``weights``: a file matched to it (``parallel.weights.match.match_weights``) that gives
    the values it holds; ``splits``: the tensors the model's own code cut (canonical name ->
    which slice of the whole tensor this rank's is)."""
    _PENDING[model] = _record(model, seed, device, weights, splits)


def pending(model: nn.Module) -> bool:
    """Whether ``model`` was recorded by :func:`defer` and is not materialized yet."""
    return model in _PENDING


def refuse_meta(model: nn.Module, who: str) -> None:
    """ValueError when ``model`` has meta tensors that no ``parallelize`` call will
    materialize (a wrapper built directly on a meta model)."""
    if not pending(model) and is_meta(model):
        name = next(n for n, t in _tensors(model) if t.is_meta)
        raise ValueError(f"{who}: '{name}' is on the meta device; give the meta model to "
                         f"parallel.parallelize (it initializes each rank's share after "
                         f"sharding) or call parallel.materialize(model) first")


def full_value(info: DeferredInit, name: str) -> torch.Tensor:
    """The whole initial value of canonical tensor ``name``, generated on the host."""
    twin = info.twin
    try:
        meta = twin.get_parameter(name)
    except AttributeError:
        meta = twin.get_buffer(name)
    if not meta.is_meta:  # a buffer the model was given real: kept
        return meta.detach().clone()
    init = getattr(twin, "init_parameter", None)
    # the host generator alone: the value is made on the host, and torch.manual_seed would also
    # reseed every accelerator's generator, which fork_rng(devices=[]) does not give back (every
    # data-parallel rank would then draw the same dropout masks)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if callable(init):
            torch.default_generator.manual_seed(stable_seed(info.seed, name))
            value = torch.empty(meta.shape, dtype=meta.dtype, device=HOST)
            init(name, value)
            return value
        path, owner, leaf = _owner(twin, name)
        torch.default_generator.manual_seed(stable_seed(info.seed, path))
        owner.to_empty(device=HOST, recurse=False)
        try:
            owner.reset_parameters()
            return getattr(owner, leaf).detach().clone()
        finally:
            owner.to_empty(device="meta", recurse=False)  # release the module's host storage


#: ``keep(name, tensor, block)``: sees each generated tensor's block (the rank's slice of its
#: full value, in the full value's dtype) before it is copied into ``tensor``
Keep = Callable[[str, torch.Tensor, torch.Tensor], None]


def _fill(model: nn.Module, info: DeferredInit, keep: Keep | None = None) -> None:
    held, names = [], []
    for name, tensor in _tensors(model):
        canonical = info.canonical.get(name)
        if canonical is None:
            raise ValueError(f"deferred initialization: '{name}' was not in the model given "
                             f"to parallel.parallelize; a step added it")
        held.append((canonical, tensor))
        names.append(name)
    from_file = set() if info.weights is None else fill_held(info.weights, held)
    with torch.no_grad():
        for name, (canonical, tensor) in zip(names, held, strict=True):
            if canonical in from_file:
                continue
            full = _cut(full_value(info, canonical), info.splits.get(canonical))
            block = full[dtensor_slice(tensor)] if isinstance(tensor, DTensor) else full
            if keep is not None:
                keep(name, tensor, block)
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local.copy_(block.to(local.dtype))
            del full, block


def _cut(full: torch.Tensor, split: Split | None) -> torch.Tensor:
    """The slice ``split`` of the whole value (``full`` itself when the tensor is not cut)."""
    if split is None:
        return full
    size = full.shape[split.dim] // split.parts
    return full.narrow(split.dim, split.index * size, size)


def materialize_pending(model: nn.Module, roots: Sequence[nn.Module] | None = None,
                        keep: Keep | None = None,
                        device: torch.device | str | None = None) -> None:
    """Give ``model`` (recorded by :func:`defer`) storage for what this rank holds and its
    values; ``roots``: the outermost modules to ``to_empty`` (FSDP2 roots wrapping ``model``),
    default ``model``; ``keep``: shown each generated block before it is stored (optimizer
    parallel's 16-bit parameters keep their FP32 values from it); ``device``: where the roots
    are allocated instead of the recorded device (the host, for shards that rest there).
    Nothing when ``model`` is not pending."""
    info = _PENDING.pop(model, None)
    if info is None:
        return
    # swap, not replace: every Parameter keeps its object, so what a wrapper captured before
    # (FSDP2's parameter records, reducers' parameter lists, ids) stays valid, and the gradient
    # hooks registered on a parameter before this point are registered again (keeping_hooks)
    # (a tensor with weak references cannot be swapped: a fake-tensor dry run of the stages
    # leaves its converter's in reference cycles, collected here, and only then: a full
    # collection costs 0.2 s and more in a process holding many objects)
    if any(weakref.getweakrefs(t) for root in roots or [model] for _, t in _tensors(root)):
        gc.collect()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for root in roots or [model]:
            # semi-auto allocates its blocks itself (parallel.weights.deferred_spmd)
            if is_meta(root):
                with keeping_hooks([root]):
                    root.to_empty(device=info.device if device is None else device)
    except RuntimeError as err:
        raise RuntimeError(f"deferred initialization: allocating the rank's tensors failed "
                           f"({err}); something outside the model still refers to a meta "
                           f"parameter (a weak reference or a view)") from err
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    left = next((n for n, t in _tensors(model) if t.is_meta), None)
    if left is not None:
        raise RuntimeError(f"deferred initialization: '{left}' is still on the meta device "
                           f"after to_empty (a module that does not move its tensors)")
    _fill(model, info, keep)


def materialize(model: nn.Module, *, seed: int = 0,
                device: torch.device | str | None = None, weights: str | Path | None = None,
                strict: bool = True) -> nn.Module:
    """Allocate and initialize a meta-device ``model`` whole, in place, in one process; returns
    it. The values are the ones ``parallel.parallelize`` gives each rank's slices of the same
    model with the same ``seed`` (the module docstring says how). ``device``: where the storage
    goes (default: the accelerator in use). ``weights``: a file whose tensors are read instead
    (``parallel.load_weights`` says which files and what ``strict`` checks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallel.materialize: expected an nn.Module, got {type(model).__name__}")
    if not is_meta(model):
        raise ValueError("parallel.materialize: the model has no tensor on the meta device; "
                         "build it under torch.device('meta')")
    matched = None if weights is None else match_weights(model, weights, strict,
                                                         "parallel.materialize")
    _PENDING[model] = _record(model, seed, device, matched)
    materialize_pending(model)
    return model
