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


@dataclass
class ParallelConfig:
    """How the model is spread over the ranks; ``mode`` is a ``parallel.ParallelMode`` name."""

    name: str = MISSING
    mode: parallel.ParallelMode = parallel.ParallelMode.STAND_ALONE


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
