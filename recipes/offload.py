"""The ``offload`` config group: the run's :class:`hetero.offload.OffloadPolicy`.

``offload=optimizer`` (``hetero.optim.OffloadAdamW``; ``offload.ratio`` keeps a share of the state
on the device), ``offload=params`` (weights at rest in host memory, one layer at a time on the
device: ``hetero.offload.ParamOffload``), ``offload=activations`` (every block's saved tensors in
host memory; the same as ``trainer.recompute=offload``). Fields combine:
``offload=params offload.activations=host``.

The previous release's spelling, ``hetero=offload`` / ``hetero.offload_optimizer=true``, still
works for one release with a ``DeprecationWarning``: it is read as ``offload.optimizer=host``,
and ``hetero.offload_optimizer`` is kept equal to ``offload.optimizer=host`` for the code that
reads it; so is ``hetero.param_dtype``, now ``offload.param_dtype`` (the dtype of the device's
copies of host-kept weights: under ``offload=params`` each layer's copy). The host kernel's
settings (``hetero.offload_kernel``, ``offload_bucket_mb``, ``host_threads``) stay in ``hetero``.

Parameter offload trains in one process, data parallel (each rank's host gradients averaged at
the end of backward; with optimizer parallel level1 each rank keeps Adam's moments for its share
only, ``hetero.offload.sharded_host_adam.ShardedHostAdamW``) or in pipeline stages (each stage's
layers offloaded; a stage is built on the device first, then moved home); with
``model.init_device=meta`` a stage-less model is materialised in host memory, never whole on the
device. Under optimizer parallel level2/3 each rank's shards of the weights and gradients rest on
its host (``parallel.enable_parallel_optimizer=true parallel.optimizer_level=level3
offload=params``: ``ParallelConfig.offload_params``, FSDP2's ``CPUOffloadPolicy``). In pipeline
stages with data-parallel replicas each stage's host gradients are averaged over its replicas
after the schedule (the pipeline's ``DataParallel``, whose buckets follow the weights to the
host); with optimizer parallel level1 there, Adam's moments are sharded over those replicas.
fp16 (``trainer.precision=fp16`` or ``offload.param_dtype=float16``) is loss-scaled over the host
gradients as under optimizer offload (``hetero.optim.LossScaler``). Under the zbv schedule one
offload holds both stages of a rank, and each stage's split weight pass brings its weights back
(``parallel.pipeline.offloaded_stage``). With tensor or expert parallel, placement tags,
``trainer.compile``, or fp16 beside the disk or sharded host optimizers it is refused by name
before any process group starts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict
from torch import nn
from torch.distributed.tensor import DTensor

import parallel
from foundation.deprecation import warn_deprecated
from hetero.offload import OffloadPolicy, ParamOffload
from parallel import ParallelConfig
from parallel.config import OperatorSplit
from recipes.optim import PARAM_DTYPES
from recipes.parallel_mode import group_split

log = logging.getLogger(__name__)


def resolve_offload(cfg: DictConfig) -> OffloadPolicy:
    """The run's policy (module docstring); ValueError naming the setting for a combination the
    recipe cannot train."""
    h, o = cfg.hetero, cfg.offload
    if h.get("offload_optimizer") and o.optimizer == "device":
        warn_deprecated("hetero.offload_optimizer=true (hetero=offload)",
                        "offload=optimizer (offload.optimizer=host)")
        with open_dict(o):
            o.optimizer = "host"
    if h.get("param_dtype") is not None and o.param_dtype is None:
        warn_deprecated(f"hetero.param_dtype={h.param_dtype}",
                        f"offload.param_dtype={h.param_dtype}")
        with open_dict(o):
            o.param_dtype = h.param_dtype
    if h.get("param_dtype") not in (None, o.param_dtype):
        raise ValueError(f"hetero.param_dtype={h.param_dtype} (the previous release's name) and "
                         f"offload.param_dtype={o.param_dtype} disagree; set "
                         f"offload.param_dtype only")
    with open_dict(h):  # the previous names, kept equal for the code that reads them
        h.offload_optimizer = o.optimizer == "host"
        h.param_dtype = o.param_dtype
    if o.optimizer == "disk":
        _check_disk(cfg)
    fields = {k: v for k, v in o.items() if k != "param_dtype"}
    if "disk" in (o.optimizer, o.params) and o.path is None:
        fields["path"] = DEFAULT_STATE_DIR  # under the run dir: state_dir() resolves it
    try:
        policy = OffloadPolicy.from_mapping(fields)
    except ValueError as err:
        raise ValueError(f"offload={o.name}: {err}") from None
    if o.param_dtype is not None and policy.params == "device" and policy.optimizer == "device":
        raise ValueError(f"offload.param_dtype={o.param_dtype} is the dtype of the device's "
                         f"copies of weights kept on the host, and offload={o.name} keeps none "
                         f"there; set offload.optimizer=host or offload.params=host (or "
                         f"trainer.precision for autocast)")
    if policy.optimizer == "host" and policy.ratio < 1 and o.param_dtype is not None \
            and cfg.trainer.precision == "fp32":
        raise ValueError(f"offload.ratio={policy.ratio} keeps {1 - policy.ratio:.0%} of the "
                         f"weights' optimizer state on the device, where those weights stay "
                         f"FP32 (their own masters), while the host's share computes in "
                         f"offload.param_dtype={o.param_dtype}: one model in two dtypes needs "
                         f"autocast (trainer.precision="
                         f"{'bf16' if o.param_dtype == 'bfloat16' else 'fp16'}) or "
                         f"offload.param_dtype=null")
    if policy.activations == "host" and cfg.trainer.recompute != "none":
        raise ValueError(f"offload.activations=host keeps every block's activations in host "
                         f"memory, and trainer.recompute={cfg.trainer.recompute} recomputes "
                         f"them: a block does one or the other (trainer.recompute=offload is "
                         f"the same as offload.activations=host)")
    if policy.params != "device":
        _check_param_offload(cfg)
    return policy


#: where ``offload.optimizer=disk`` keeps its files without ``offload.path``: in the run dir
DEFAULT_STATE_DIR = "optimizer_state"


def state_dir(cfg: DictConfig, run_dir: Path) -> Path:
    """The directory of ``offload.optimizer=disk``'s and ``offload.params=disk``'s files (made
    if missing)."""
    path = Path(cfg.offload.path) if cfg.offload.path else run_dir / DEFAULT_STATE_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def level1_on_host(fields: Any, offload: DictConfig) -> bool:
    """Whether the ``parallel`` group (``fields``) asks for optimizer parallel level1 while
    ``offload`` keeps the weights on the host: every rank then holds its stage's whole weights
    there, and only Adam's moments are sharded, by :class:`~hetero.offload.sharded_host_adam
    .ShardedHostAdamW` over the ranks that hold the same weights, not by the layout."""
    return bool(offload.params != "device" and fields.get("enable_parallel_optimizer")
                and fields.get("optimizer_level", "level1") == "level1")


def without_level1(fields: DictConfig, offload: DictConfig) -> DictConfig:
    """The ``parallel`` group to lay the model out by: in pipeline stages under
    :func:`level1_on_host`, without optimizer parallel (each stage's replicas average their host
    gradients; the optimizer shards the moments), else ``fields`` itself."""
    if not (level1_on_host(fields, offload) and fields.get("pipeline_degree", 1) > 1):
        return fields
    laid = fields.copy()
    with open_dict(laid):
        laid.enable_parallel_optimizer = False
    return laid


def shard_group(config: ParallelConfig, fields: Any, offload: DictConfig) -> Any:
    """The group of ranks holding the same weights that Adam's moments are sharded over under
    :func:`level1_on_host` (the data ranks; in pipeline stages a stage's replicas), or None."""
    if not level1_on_host(fields, offload) or config.batch_ranks == 1:
        return None
    if config.pipeline_degree > 1:
        return parallel.dims.ParallelDims(config)["replicas"].get_group()
    return parallel.mesh.batch_mesh(config).get_group()


def _check_disk(cfg: DictConfig) -> None:
    p, o = cfg.parallel, cfg.offload
    problems = []
    if group_split(p) is not OperatorSplit.REPLICAS or p.get("expert_degree", 1) > 1:
        problems.append(f"parallel={p.name} (the disk tier trains with parallel=none, data, "
                        f"pipeline and optimizer parallel; with tensor or expert parallel it is "
                        f"not built yet)")
    elif o.params != "device" and p.get("enable_parallel_optimizer"):
        problems.append(f"optimizer parallel with offload.params={o.params} (the weights rest "
                        f"whole on each host, so the disk state would not be sharded: "
                        f"offload.optimizer=host shards the moments there)")
    if o.param_dtype is not None:
        problems.append(f"offload.param_dtype={o.param_dtype} (the model keeps its dtype: use "
                        f"trainer.precision for 16-bit compute)")
    if cfg.optim.optimizer.get("_target_") != "torch.optim.AdamW":
        problems.append(f"optim={cfg.optim.name} (the disk tier steps AdamW: optim=adamw)")
    if problems:
        raise ValueError("offload.optimizer=disk cannot train with " + "; ".join(problems))


def _check_param_offload(cfg: DictConfig) -> None:
    p = cfg.parallel
    problems = []
    level = p.get("optimizer_level") if p.get("enable_parallel_optimizer") else None
    if group_split(p) is not OperatorSplit.REPLICAS or p.get("expert_degree", 1) > 1:
        problems.append(f"parallel={p.name} (parameter offload trains with parallel=none, "
                        f"parallel=data or pipeline stages; with tensor or expert parallel it "
                        f"is not built yet)")
    elif level in ("level2", "level3") and (cfg.offload.params != "host"
                                            or cfg.offload.param_dtype is not None):
        why = (f"offload.params={cfg.offload.params}" if cfg.offload.params != "host" else
               f"offload.param_dtype={cfg.offload.param_dtype} (each rank's shards at rest on "
               f"the host are its FP32 weights)")
        problems.append(f"optimizer parallel {level} with {why}: not built yet")
    if cfg.hetero.cpu_modules:
        problems.append("hetero.cpu_modules (a placed model runs captured partitions, not its "
                        "layers)")
    if cfg.trainer.compile:
        problems.append("trainer.compile=true (the layers' weights move between steps)")
    fp16 = cfg.trainer.precision == "fp16" or cfg.offload.param_dtype == "float16"
    if fp16 and (cfg.offload.optimizer != "host" or level is not None):
        # the loss scaler unscales and checks the host gradients of hetero.optim.OffloadAdamW;
        # the disk and the sharded host optimizers have no such hand-off yet
        beside = (f"optimizer parallel {level}" if level is not None else
                  f"offload.optimizer={cfg.offload.optimizer}")
        problems.append(f"fp16 with {beside} (loss scaling over their host gradients is not "
                        f"built; use bf16, or offload.optimizer=host without optimizer parallel)")
    if problems:
        raise ValueError(f"offload.params={cfg.offload.params} cannot train with "
                         + "; ".join(problems))


def offload_params(model: nn.Module, policy: OffloadPolicy, config: ParallelConfig,
                   hetero: DictConfig, device: torch.device, disk_path: Path | None = None
                   ) -> list[ParamOffload]:
    """``model``'s weights offloaded: a plain model (on the host), data parallel over the batch
    ranks averaging the host gradients (``config`` resolved for this world); or each stage of a
    ``Pipeline`` this rank runs. ``disk_path``: ``offload.params=disk``'s directory."""
    group = None
    if config.operator_split is OperatorSplit.REPLICAS and config.batch_ranks > 1:
        group = parallel.mesh.batch_mesh(config).get_group()
    dtype = PARAM_DTYPES[hetero.param_dtype] if hetero.get("param_dtype") else None  # mirrored
    # one offload over the stages a rank runs: a weight two of them share (zbv's tied
    # embedding and head) has one home
    parts = ([stage.submod for stage in model.stages]
             if isinstance(model, parallel.pipeline.Pipeline) else [model])
    offloads = [ParamOffload(parts, device=device, prefetch=policy.prefetch, compute_dtype=dtype,
                             reduce_group=None if config.pipeline_degree > 1 else group,
                             disk_path=disk_path)]
    log.info("parameter offload: %d layers on the device one at a time (prefetch %d), %s "
             "weights at rest %s%s", sum(len(o.units) for o in offloads),
             policy.prefetch, _size(sum(p.nbytes for p in model.parameters())),
             f"in a file under {disk_path}" if disk_path is not None else "in host memory",
             f", gradients averaged over {config.batch_ranks} ranks"
             if group is not None and config.pipeline_degree == 1 else "")
    return offloads


def _size(n: Any) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_plan(model: nn.Module, optimizer: torch.optim.Optimizer,
                offloads: list[ParamOffload], host_shards: bool = False) -> str:
    """One line for the log before the first step: the bytes this rank keeps on the device, in
    host memory and on disk, counted from what the run built (the weights where they rest, the
    optimizer's own buffers and files; activations and gradients in flight are not counted).
    ``host_shards``: the weights' shards rest on the host (``ParallelConfig.offload_params``)."""
    from hetero.offload.disk_adam import DiskAdamW
    from hetero.offload.sharded_host_adam import ShardedHostAdamW
    from hetero.optim import OffloadAdam

    held = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]  # rank's
    weights = sum(p.numel() * p.element_size() for p in held)
    device_b = host_b = disk_b = 0
    if offloads:  # weights at rest off the device; the device holds a few layers at a time
        if offloads[0].file is not None:  # with their gradients, in a file
            disk_b += sum(o.file.nbytes for o in offloads)
        else:
            host_b += weights
        device_b += sum(_resident_bytes(o) for o in offloads)
    elif host_shards:  # this rank's shards (FSDP2 gathers a layer at a time on the device)
        shards = sum(p.to_local().nbytes for p in model.parameters() if isinstance(p, DTensor))
        host_b += shards
        device_b += weights - shards  # the small ones, replicated
    else:  # (without an accelerator "device" is host memory too)
        device_b += weights
    if isinstance(optimizer, DiskAdamW):
        disk_b += sum(space.file.chunks * space.file.chunk_bytes for space in optimizer._spaces)
        host_b += sum(b.nbytes for b in optimizer._buffers) + optimizer._grads.nbytes
    elif isinstance(optimizer, ShardedHostAdamW):  # this rank's share of the moments
        host_b += sum(r.exp_avg.nbytes + r.exp_avg_sq.nbytes for r in optimizer._ranges)
    elif isinstance(optimizer, OffloadAdam):
        stats = optimizer.memory_stats()
        host_b += stats["host_bytes"]
        if offloads:  # in-place slots: the moments beside the host weights
            host_b += sum(8 * p.numel() for p in held)
    else:  # torch's AdamW: both moments beside the weights
        device_b += sum(2 * p.numel() * 4 for p in held)
    return (f"memory plan per rank: device {_size(device_b)}, host {_size(host_b)}, disk "
            f"{_size(disk_b)} (weights at rest and optimizer state; activations and gradients "
            f"in flight come on top)")


def _resident_bytes(offload: ParamOffload) -> int:
    """Bytes of device copies at most at once: the root and prefetch + 1 layers."""
    itemsize = offload.compute_dtype.itemsize if offload.compute_dtype else None

    def size(homes: list) -> int:
        return sum(h.param.numel() * (itemsize or h.host.element_size()) for h in homes)

    layers = sorted((size(homes) for homes in offload.unit_homes), reverse=True)
    return size(offload.root_homes) + sum(layers[:offload.prefetch + 1])
