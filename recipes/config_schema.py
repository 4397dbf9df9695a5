"""Typed schemas for the recipe configs in ``conf/``, registered in Hydra's ConfigStore.

Each YAML file in ``conf/`` starts its defaults list with one of the schemas stored here, so Hydra
checks every key and value against a dataclass while it composes: a typo such as ``optim.lrr=1``
or a wrong type such as ``trainer.max_steps=abc`` fails before any work starts, with Hydra's own
message naming the bad key. Keys added with Hydra's ``+`` prefix skip that check, so
:func:`check_known_keys` rejects them before the run starts (nothing would read them). The
dataclass defaults are only fallbacks; the YAML files hold the values a run uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

import parallel


@dataclass
class GPTConfig:
    """Decoder-only transformer (see ``gpt.py``); the vocabulary size comes from the tokenizer."""

    name: str = "gpt"
    d_model: int = 192
    n_layer: int = 4
    n_head: int = 6
    block_size: int = 64
    dropout: float = 0.0


@dataclass
class CorpusConfig:
    """The generated corpus (see ``corpus.py``) and how training batches are cut from it."""

    name: str = "grammar"
    corpus_seed: int = 1234
    num_chars: int = 1_000_000
    cache_dir: str = "data"
    global_batch_size: int = 32
    seq_len: int = 64


@dataclass
class OptimConfig:
    """Settings shared by every optimizer: LR schedule (linear warmup, cosine decay), clipping."""

    name: str = MISSING
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    # Steps the schedule spans; null means trainer.max_steps. Pin it when a run is stopped early
    # on purpose and resumed later, so both halves follow the same schedule.
    total_steps: int | None = None
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0


@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = False


@dataclass
class HeteroConfig:
    """Where the model lives. ``device`` is a logical name for ``hetero.device.resolve``."""

    name: str = "none"
    device: str = "device"
    # Module paths tagged hetero.set_device(..., "cpu"); non-empty means hetero.place the model.
    cpu_modules: list[str] = field(default_factory=list)
    # hetero.optim.OffloadAdamW: FP32 master + Adam moments on the host (needs optim=adamw).
    offload_optimizer: bool = False
    param_dtype: str | None = None      # model weights under offload: bfloat16 | float16 | null
    offload_kernel: str = "auto"        # host update: auto | compiled | torch | deepspeed
    offload_bucket_mb: float = 25.0     # gradient bytes per device->host copy


@dataclass
class ParallelConfig:
    """How the model is spread over the ranks; ``mode`` is a ``parallel.ParallelMode`` name."""

    name: str = MISSING
    mode: parallel.ParallelMode = parallel.ParallelMode.STAND_ALONE
    # semi_auto only: a strategy file (a name in conf/strategy/, or a path to a YAML file) mapping
    # module paths to shard strategies, whose "mp"/"dp" entries are filled in from
    # model_parallel (null: every rank) and world_size / model_parallel.
    strategy: str | None = None
    model_parallel: int | None = None


@dataclass
class TrainerConfig:
    """Loop settings. Paths are relative to the run directory (``hydra.run.dir``)."""

    max_steps: int = 300
    log_every: int = 25
    checkpoint_every: int = 100
    checkpoint_dir: str = "checkpoints"
    seed: int = 0
    # null: start fresh | "latest": newest checkpoint of this run dir | a checkpoint directory
    resume_from: str | None = None
    progress_bar: bool = True


@dataclass
class TrainConfig:
    """The top-level config (``conf/train.yaml``)."""

    model: GPTConfig = MISSING
    data: CorpusConfig = MISSING
    optim: OptimConfig = MISSING
    hetero: HeteroConfig = MISSING
    parallel: ParallelConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ----------------------------------------------------------------- Wide&Deep (recipes/wide_deep.py)


@dataclass
class WideDeepModelConfig:
    """Wide&Deep (``wide_deep_model.py``); the vocabulary size comes from ``data.vocab_size``."""

    name: str = "wide_deep"
    embedding_size: int = 16
    deep_layers: list[int] = field(default_factory=lambda: [256, 128])
    dropout: float = 0.0
    embedding_target: str = "CPU"  # hetero.nn.EmbeddingLookup target: CPU | DEVICE


@dataclass
class CriteoConfig:
    """Criteo-format data (``criteo.py``): a real file, or one generated with a planted signal."""

    name: str = "criteo"
    path: str | None = None   # a Criteo TSV (e.g. Kaggle train.txt); null: generate one
    cache_dir: str = "data"
    seed: int = 1234          # of the generated file
    rows: int = 200_000       # of the generated file
    max_rows: int | None = None
    vocab_size: int = 200_000  # hash buckets shared by the 26 categorical fields
    eval_fraction: float = 0.1
    global_batch_size: int = 1024
    eval_batch_size: int = 8192


@dataclass
class SparseOptimConfig:
    """The optimizer of the embedding tables (row-sparse gradients, updated on the host)."""

    name: str = MISSING
    weight_decay: float = 0.0


@dataclass
class LazyAdamConfig(SparseOptimConfig):
    name: str = "lazy_adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    use_nesterov: bool = False


@dataclass
class FTRLConfig(SparseOptimConfig):
    name: str = "ftrl"
    learning_rate: float = 0.05
    initial_accum: float = 0.1
    lr_power: float = -0.5
    l1: float = 0.0
    l2: float = 0.0


@dataclass
class WideDeepTrainerConfig:
    """Loop settings of the Wide&Deep recipe (evaluation: AUC on the held-out split)."""

    max_steps: int = 1000
    log_every: int = 100
    eval_every: int = 250
    seed: int = 0
    progress_bar: bool = True


@dataclass
class WideDeepTrainConfig:
    """The top-level config of ``conf/wide_deep.yaml``; ``optim`` drives the dense part."""

    model: WideDeepModelConfig = MISSING
    data: CriteoConfig = MISSING
    optim: OptimConfig = MISSING
    sparse_optim: SparseOptimConfig = MISSING
    hetero: HeteroConfig = MISSING
    parallel: ParallelConfig = MISSING
    trainer: WideDeepTrainerConfig = field(default_factory=WideDeepTrainerConfig)


def register_configs() -> None:
    """Store the schemas under the names the YAML defaults lists use (safe to call again)."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="gpt_schema", node=GPTConfig)
    cs.store(group="data", name="corpus_schema", node=CorpusConfig)
    cs.store(group="optim", name="adamw_schema", node=AdamWConfig)
    cs.store(group="optim", name="sgd_schema", node=SGDConfig)
    cs.store(group="hetero", name="hetero_schema", node=HeteroConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelConfig)
    cs.store(name="wide_deep_schema", node=WideDeepTrainConfig)
    cs.store(group="model", name="wide_deep_schema", node=WideDeepModelConfig)
    cs.store(group="data", name="criteo_schema", node=CriteoConfig)
    cs.store(group="sparse_optim", name="lazy_adam_schema", node=LazyAdamConfig)
    cs.store(group="sparse_optim", name="ftrl_schema", node=FTRLConfig)


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Dotted paths of keys that are not fields of their node's schema dataclass."""
    schema = OmegaConf.get_type(cfg)
    is_schema = dataclasses.is_dataclass(schema)
    known = {f.name for f in dataclasses.fields(schema)} if is_schema else None
    found = []
    for key in cfg.keys():
        if known is not None and key not in known:
            found.append(f"{prefix}{key}")
        elif isinstance(cfg[key], DictConfig):
            found += unknown_keys(cfg[key], f"{prefix}{key}.")
    return found


def check_known_keys(cfg: DictConfig) -> None:
    """Raise ValueError naming every key no schema declares (e.g. added as ``+optim.lrr=1``)."""
    if bad := unknown_keys(cfg):
        raise ValueError(f"unknown config key(s) {', '.join(bad)}: not in the schemas of "
                         f"recipes/config_schema.py, so nothing would read them (a typo?)")
