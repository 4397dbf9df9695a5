"""Typed schemas of the Wide&Deep recipe's configs (``conf/wide_deep.yaml`` and its groups).

Registered with the GPT recipe's by ``recipes.config_schema.register_configs``; the rules work the
same way (``recipes/config_rules.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from recipes.config_rules import rule
from recipes.config_schema import HeteroConfig, OptimConfig
from recipes.loggers import LOGGERS
from recipes.parallel_schema import ParallelGroupConfig


@dataclass
class WideDeepModelConfig:
    """Wide&Deep (``wide_deep_model.py``); the vocabulary size comes from ``data.vocab_size``."""

    name: str = "wide_deep"
    embedding_size: int = rule(16, ge=1)
    deep_layers: list[int] = rule([256, 128], ge=1, each=True)
    dropout: float = rule(0.0, ge=0, lt=1)
    # hetero.nn.EmbeddingLookup target: CPU | DEVICE
    embedding_target: str = rule("CPU", choices=("CPU", "DEVICE"))
    # none: each rank holds the whole tables | row: the parameter server, each rank holding one
    # block of every table's rows (host tables only), looked up and updated over all-to-all
    embedding_sharding: str = rule("none", choices=("none", "row"))
    # with embedding_sharding=row: this many of the hottest rows of each table held on every
    # rank (and trained there exactly as in their owners' blocks); null: no cache
    embedding_cache_size: int | None = rule(None, ge=1)
    # true: the host tables (each rank's blocks of them) and their sparse optimizer's state rest
    # in files under the run dir's tables/ (paged in as rows are touched) instead of host memory
    embedding_disk: bool = False


@dataclass
class CriteoConfig:
    """Criteo-format data (``criteo.py``): a real file, or one generated with a planted signal."""

    name: str = "criteo"
    path: str | None = None   # a Criteo TSV (e.g. Kaggle train.txt); null: generate one
    cache_dir: str = "data"
    seed: int = rule(1234, ge=0)        # of the generated file
    rows: int = rule(200_000, ge=2)     # of the generated file
    max_rows: int | None = rule(None, ge=2)
    vocab_size: int = rule(200_000, ge=1)  # hash buckets shared by the 26 categorical fields
    eval_fraction: float = rule(0.1, gt=0, lt=1)
    global_batch_size: int = rule(1024, ge=1)
    eval_batch_size: int = rule(8192, ge=1)


@dataclass
class SparseOptimConfig:
    """The optimizer of the embedding tables (row-sparse gradients, updated on the host)."""

    name: str = MISSING
    weight_decay: float = rule(0.0, ge=0)
    # built with hydra.utils.instantiate(optimizer, tables): _target_ and the constructor's keys
    optimizer: dict[str, Any] = field(default_factory=dict)


@dataclass
class LazyAdamConfig(SparseOptimConfig):
    name: str = "lazy_adam"
    lr: float = rule(1e-3, ge=0)
    betas: list[float] = rule([0.9, 0.999], ge=0, lt=1, each=True, length=2)
    eps: float = rule(1e-8, ge=0)
    use_nesterov: bool = False


@dataclass
class FTRLConfig(SparseOptimConfig):
    name: str = "ftrl"
    learning_rate: float = rule(0.05, gt=0)
    initial_accum: float = rule(0.1, ge=0)
    lr_power: float = rule(-0.5, le=0)
    l1: float = rule(0.0, ge=0)
    l2: float = rule(0.0, ge=0)


@dataclass
class WideDeepTrainerConfig:
    """Loop settings of the Wide&Deep recipe (evaluation: AUC on the held-out split)."""

    max_steps: int = rule(1000, ge=1)
    log_every: int = rule(100, ge=1)
    eval_every: int = rule(250, ge=1)
    # checkpoints (tables, dense part, both optimizers) as the GPT recipe writes them
    checkpoint_every: int = rule(250, ge=1)
    checkpoint_dir: str = "checkpoints"
    seed: int = rule(0, ge=0)
    run_name: str | None = None  # a name: the run dir is outputs/wide_deep/runs/NAME
    resume_from: str | None = None  # null | latest | path/to/checkpoints/step_000250
    resume_digest: str | None = None  # "sha256:...": the digest the resumed checkpoint must have
    allow_partial_resume: bool = False
    progress_bar: bool = True
    on_nonfinite_loss: str = rule("stop", choices=("stop", "skip"))  # NaN/Inf loss: stop | skip
    collective_timeout_s: float | None = rule(None, gt=0)  # as the GPT recipe's trainer
    profile_steps: list[int] | None = rule(None, ge=1, each=True, length=2)  # a profiler trace


@dataclass
class WideDeepTrainConfig:
    """The top-level config of ``conf/wide_deep.yaml``; ``optim`` drives the dense part."""

    model: WideDeepModelConfig = MISSING
    data: CriteoConfig = MISSING
    optim: OptimConfig = MISSING
    sparse_optim: SparseOptimConfig = MISSING
    hetero: HeteroConfig = MISSING
    parallel: ParallelGroupConfig = MISSING
    trainer: WideDeepTrainerConfig = field(default_factory=WideDeepTrainerConfig)
    logger: list[str] = rule(["jsonl"], choices=LOGGERS, each=True)  # recipes/loggers.py
