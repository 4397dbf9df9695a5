"""Typed schemas for the recipe configs in ``conf/``, registered in Hydra's ConfigStore.

Each YAML file in ``conf/`` starts its defaults list with one of the schemas stored here, so Hydra
checks every key and value against a dataclass while it composes: a typo such as ``optim.lrr=1``
or a wrong type such as ``trainer.max_steps=abc`` fails before any work starts, with Hydra's own
message naming the bad key. Keys added with Hydra's ``+`` prefix skip that check, so
:func:`check_known_keys` rejects them before the run starts (nothing would read them). Ranges are
part of the schema too: a field's ``metadata`` holds its rule (``recipes/config_rules.py``), and
:func:`check_values` refuses every impossible value (``optim.grad_clip=-1``,
``trainer.checkpoint_every=0``, ``trainer.max_steps=-5``, ...) by name before any work starts.
The dataclass defaults are only fallbacks; the YAML files hold the values a run uses.

``optim.optimizer`` and ``sparse_optim.optimizer`` are the components a recipe builds with
``hydra.utils.instantiate``: ``_target_`` names the class, the other keys interpolate the group's
own values (``lr: ${..lr}``), so ``optim.lr=1e-3`` on the command line still reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from recipes.config_rules import check_config, check_known_keys, check_values, rule
from recipes.loggers import LOGGERS
from recipes.parallel_schema import ParallelGroupConfig

__all__ = ["check_config", "check_known_keys", "check_values", "register_configs"]


@dataclass
class GPTConfig:
    """Decoder-only transformer (see ``gpt.py``); the vocabulary size comes from the tokenizer."""

    name: str = "gpt"
    d_model: int = rule(192, ge=1)
    n_layer: int = rule(4, ge=1)
    n_head: int = rule(6, ge=1)
    block_size: int = rule(64, ge=1)
    dropout: float = rule(0.0, ge=0, lt=1)
    # mixture of experts (model=gpt_moe): 0 experts = every MLP dense; else every moe_every-th
    # block's MLP is a parallel.nn.MoE with these settings
    num_experts: int = rule(0, ge=0)
    moe_every: int = rule(1, ge=1)
    top_k: int = rule(2, ge=1)
    capacity_factor: float = rule(1.1, gt=0)
    aux_loss_factor: float = rule(0.05, ge=0)
    dropless: bool = False
    # "meta": built without storage; parallelize allocates and initializes each rank's share
    # after the split and sharding, from trainer.seed (docs/deferred-init.md); "device": built
    # whole on every rank first; "auto": meta wherever the layout takes it, else the whole
    # model from the same seed (recipes/model_init.py)
    init_device: str = rule("auto", choices=("auto", "device", "meta"))
    # a local checkpoint the initial values come from instead of trainer.seed (a .safetensors
    # file, a save_pretrained directory or a DCP directory); each rank reads only its block of
    # each tensor, so it needs init_device=meta (docs/deferred-init.md, "Loading weights")
    weights: str | None = None

    @staticmethod
    def cross_check(cfg: DictConfig) -> list[str]:
        problems = []
        if cfg.weights is not None and cfg.init_device == "device":
            problems.append(f"weights={cfg.weights} needs init_device=meta or auto: each rank "
                            f"reads its share of the file as the meta model is materialized (a "
                            f"model built whole first would hold every tensor)")
        if cfg.d_model % cfg.n_head:
            problems.append(f"d_model={cfg.d_model} must be a multiple of n_head={cfg.n_head}")
        if cfg.num_experts and cfg.top_k > cfg.num_experts:
            problems.append(f"top_k={cfg.top_k} exceeds num_experts={cfg.num_experts}")
        return problems


@dataclass
class HFModelConfig:
    """A HuggingFace ``transformers`` causal LM (``recipes/hf_model.py``): from a local
    ``save_pretrained`` directory (``path``) or a config given inline (``config``, with its
    ``model_type``; random init). The vocabulary size comes from the tokenizer."""

    name: str = "hf"
    path: str | None = None
    config: Any = None  # a mapping: {model_type: llama, hidden_size: 64, ...}
    block_size: int = rule(64, ge=1)  # the context trained on (data.seq_len follows it)
    # null: transformers' default (sdpa); eager | sdpa | ... as transformers names them
    attn_implementation: str | None = None
    # eager: HF's per-expert loop (MoE families); null: transformers' pick (grouped_mm)
    experts_implementation: str | None = "eager"
    # "meta" is refused for this model (deferred init replays the recipe GPT's init only);
    # "auto" builds it on the device
    init_device: str = rule("auto", choices=("auto", "device", "meta"))

    @staticmethod
    def cross_check(cfg: DictConfig) -> list[str]:
        if cfg.path is None and not cfg.config:
            return ["path and config are both unset: model=hf needs one of them (a "
                    "save_pretrained directory, or {model_type: llama, ...} given inline)"]
        if cfg.path is not None and cfg.config:
            return [f"path={cfg.path} and config are both set: give one of them"]
        if cfg.config and "model_type" not in cfg.config:
            return ["config needs its model_type (llama, qwen2, gpt2, mixtral, ...)"]
        return []


@dataclass
class CustomModelConfig:
    """Your own model class (``model._target_``), built with ``kwargs`` (and ``vocab_size``, the
    tokenizer's, when its constructor takes it); see docs/your-model.md for the contract."""

    name: str = "custom"
    _target_: str = MISSING
    kwargs: Any = None  # a mapping of the constructor's keyword arguments
    block_size: int = rule(64, ge=1)  # the context trained on (data.seq_len follows it)
    # "meta" is refused for this model (deferred init replays the recipe GPT's init only);
    # "auto" builds it on the device
    init_device: str = rule("auto", choices=("auto", "device", "meta"))


@dataclass
class CorpusConfig:
    """The generated corpus (see ``corpus.py``) and how training batches are cut from it."""

    name: str = "grammar"
    corpus_seed: int = 1234
    num_chars: int = rule(1_000_000, ge=1)
    cache_dir: str = "data"
    global_batch_size: int = rule(32, ge=1)
    seq_len: int = rule(64, ge=1)


@dataclass
class TextDataConfig:
    """Your own text (``recipes/text_data.py``): files, a tokenizer, a held-out split."""

    name: str = "text"
    path: str = MISSING  # a .txt/.jsonl file, a directory of them, or a glob
    jsonl_field: str = "text"
    tokenizer: str | None = None  # a tokenizer.json or HF tokenizer dir; null: train a BPE
    vocab_size: int = rule(512, ge=257)  # of the trained byte-level BPE (256 bytes + 1 special)
    eval_fraction: float = rule(0.05, ge=0, lt=1)  # the held-out tail of the token stream
    cache_dir: str = "data"
    global_batch_size: int = rule(32, ge=1)
    seq_len: int = rule(64, ge=1)


@dataclass
class StreamDataConfig:
    """Files streamed through HuggingFace ``datasets`` (``recipes/streamed_data.py``): epochs,
    a seeded order, packed windows and a data position kept in the checkpoint."""

    name: str = "stream"
    path: str = MISSING  # .txt/.jsonl/.parquet files: a file, a directory or a glob, one format
    field: str = "text"  # the record's text column (.jsonl, .parquet)
    tokenizer: str | None = None  # a tokenizer.json or HF tokenizer dir; null: train a BPE
    vocab_size: int = rule(512, ge=257)
    shuffle_buffer: int = rule(1000, ge=0)  # records shuffled in a buffer per epoch; 0: in order
    eval_path: str | None = None  # held-out files of the same format for trainer.eval_every
    cache_dir: str = "data"
    global_batch_size: int = rule(32, ge=1)
    seq_len: int = rule(64, ge=1)


@dataclass
class OptimConfig:
    """Settings shared by every optimizer: LR schedule (linear warmup, then ``schedule``),
    clipping."""

    name: str = MISSING
    lr: float = rule(1e-3, ge=0)
    weight_decay: float = rule(0.0, ge=0)
    warmup_steps: int = rule(0, ge=0)
    # Steps the schedule spans; null means trainer.max_steps. Pin it when a run is stopped early
    # on purpose and resumed later, so both halves follow the same schedule.
    total_steps: int | None = rule(None, ge=1)
    min_lr_ratio: float = rule(0.1, ge=0, le=1)
    # after the warm-up: cosine | linear | constant | wsd (warmup-stable-decay: the peak held,
    # then a linear decay over the last decay_fraction of the steps); recipes/schedules.py
    schedule: str = rule("cosine", choices=("cosine", "linear", "constant", "wsd"))
    decay_fraction: float = rule(0.2, gt=0, le=1)
    grad_clip: float | None = rule(1.0, gt=0)   # null: no clipping
    # built with hydra.utils.instantiate(optimizer, params): _target_ and the constructor's keys
    optimizer: dict[str, Any] = field(default_factory=dict)


@dataclass
class AdamWConfig(OptimConfig):
    name: str = "adamw"
    betas: list[float] = rule([0.9, 0.95], ge=0, lt=1, each=True, length=2)
    eps: float = rule(1e-8, ge=0)


@dataclass
class SGDConfig(OptimConfig):
    name: str = "sgd"
    momentum: float = rule(0.9, ge=0)
    nesterov: bool = False


@dataclass
class HeteroConfig:
    """Where the model lives. ``device`` is a logical name for ``hetero.device.resolve``."""

    name: str = "none"
    device: str = "device"
    # Module paths tagged hetero.set_device(..., "cpu"); non-empty means hetero.place the model.
    cpu_modules: list[str] = field(default_factory=list)
    # deprecated spelling of offload.optimizer=host (offload=optimizer); kept equal to it
    offload_optimizer: bool = False
    # deprecated spelling of offload.param_dtype; kept equal to it
    param_dtype: str | None = rule(None, choices=("bfloat16", "float16"))
    # host update: auto | compiled | torch | deepspeed
    offload_kernel: str = rule("auto", choices=("auto", "compiled", "torch", "deepspeed"))
    offload_bucket_mb: float = rule(25.0, gt=0)  # gradient bytes per device->host copy
    # host update threads; null: the cores this rank owns (affinity, or cores / local ranks)
    host_threads: int | None = rule(None, ge=1)


@dataclass
class OffloadGroupConfig:
    """Where each kind of training state lives (``hetero.offload.OffloadPolicy``'s fields)."""

    name: str = "none"
    # weights and gradients: device | host (at rest in host memory, one layer on the device) |
    # disk (at rest in a file under path, paged in a layer at a time)
    params: str = rule("device", choices=("device", "host", "disk"))
    # FP32 master + Adam moments and the update: device | host (hetero.optim.OffloadAdamW) |
    # disk (hetero.offload.DiskAdamW: in files under path, streamed a chunk at a time)
    optimizer: str = rule("device", choices=("device", "host", "disk"))
    ratio: float = rule(1.0, ge=0, le=1)  # optimizer=host: the share of the state on the host
    # what each block saves for backward: none (kept where made) | host
    activations: str = rule("none", choices=("none", "host"))
    prefetch: int = rule(1, ge=0)  # params=host|disk: layers copied to the device ahead of use
    # optimizer=disk, params=disk: the directory of their files (null: the run dir's
    # optimizer_state/)
    path: str | None = None
    # the device's copies of host-kept weights: bfloat16 | float16 (adds loss scaling) | null
    # (their dtype); optimizer=host: the weights the model computes with, params=host: each
    # layer's copy on the device
    param_dtype: str | None = rule(None, choices=("bfloat16", "float16"))


@dataclass
class TrainerConfig:
    """Loop settings. Paths are relative to the run directory (``hydra.run.dir``)."""

    max_steps: int = rule(300, ge=1)
    log_every: int = rule(25, ge=1)
    checkpoint_every: int = rule(100, ge=1)
    # also a checkpoint whenever this many minutes have passed since the last one (rank 0's
    # clock decides for all, recipes/checkpoint_clock.py); null: by steps only
    checkpoint_every_minutes: float | None = rule(None, gt=0)
    checkpoint_dir: str = "checkpoints"
    # write checkpoints while training goes on (recipes/checkpoint_async.py): one save in
    # flight, published as step_N/ once every rank's part is written
    checkpoint_async: bool = False
    seed: int = rule(0, ge=0)
    # a name: the run dir is outputs/runs/NAME at every launch (unless hydra.run.dir is given)
    run_name: str | None = None
    # null: start fresh | "latest": newest checkpoint of this run dir | "auto": the same, and a
    # fresh start without a warning when there is none yet (jobs restarted by torchrun
    # --max-restarts) | a checkpoint directory
    resume_from: str | None = None
    # the digest the resumed checkpoint must have ("sha256:...", logged when it was saved): pins
    # a checkpoint received from elsewhere; null: any checkpoint whose own checksums hold
    resume_digest: str | None = None
    # resume into a model whose parameters differ from the checkpoint's (missing, unexpected or
    # reshaped ones keep their fresh values); false: such a resume is refused, naming them
    allow_partial_resume: bool = False
    progress_bar: bool = True
    on_nonfinite_loss: str = rule("stop", choices=("stop", "skip"))  # NaN/Inf loss: stop | skip
    # seconds a collective may wait for a peer before it fails (CollectiveError); null:
    # $HETERO_PARALLEL_TIMEOUT_S or 600 (docs/accelerators.md: what a dead peer does per backend)
    collective_timeout_s: float | None = rule(None, gt=0)
    # activation recompute of every transformer block (parallel.recompute): none | selective
    # (keep the linear layers' outputs, recompute attention's core and the rest) | full |
    # offload (nothing recomputed: what each block saves waits in host memory)
    recompute: str = rule("none", choices=("none", "selective", "full", "offload"))
    # micro-steps whose gradients one update accumulates (each feeds 1/N of the step's batch;
    # under pipeline stages they are N times parallel.micro_batches)
    grad_accum_steps: int = rule(1, ge=1)
    # eval loss on held-out data every N steps (0: never) over eval_batches global batches
    eval_every: int = rule(0, ge=0)
    eval_batches: int = rule(4, ge=1)
    # see docs/see-the-run.md: autocast precision, torch.compile, checkpoints kept (null: all),
    # a profiler trace of steps [first, last]
    precision: str = rule("fp32", choices=("fp32", "bf16", "fp16"))
    # kernels that give the same bits every run (torch.use_deterministic_algorithms, and on a
    # GPU cuBLAS's fixed workspace): a resumed run's losses then equal the uninterrupted run's
    # on a device too; slower, and an operator without such a kernel stops the run, named
    deterministic: bool = False
    compile: bool = False
    keep_last: int | None = rule(None, ge=1)
    profile_steps: list[int] | None = rule(None, ge=1, each=True, length=2)
    # the device's peak TFLOP/s for MFU (recipes/mfu.py); null: its cluster preset, or on a host
    # the FLOP/s parallel.auto.profile_devices() measured (no MFU where neither is known)
    peak_tflops: float | None = rule(None, gt=0)
    # at each log line, the rank whose forward lags the median by more than this fraction is
    # named in the log (recipes/stragglers.py); null: not watched
    straggler_threshold: float | None = rule(0.2, ge=0)
    # FOR TESTS of recovery only: [RANK, STEP] kills rank RANK (SIGKILL) as step STEP begins,
    # in the job's first attempt only (recipes/fault_injection.py); null: never
    kill_at: list[int] | None = rule(None, ge=0, each=True, length=2)
    # what kill_at kills: the rank | its node (its torchrun agent's process group)
    kill_scope: str = rule("rank", choices=("rank", "node"))


@dataclass
class TrainConfig:
    """The top-level config (``conf/train.yaml``)."""

    model: Any = MISSING  # GPTConfig, HFModelConfig or CustomModelConfig, by the group's schema
    data: Any = MISSING  # CorpusConfig, TextDataConfig or StreamDataConfig, by the data group
    optim: OptimConfig = MISSING
    hetero: HeteroConfig = MISSING
    offload: OffloadGroupConfig = MISSING
    parallel: ParallelGroupConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # where per-step metrics go (recipes/loggers.py), rank 0 only
    logger: list[str] = rule(["jsonl"], choices=LOGGERS, each=True)

    @staticmethod
    def cross_check(cfg: DictConfig) -> list[str]:
        # was refused only by the model's first forward, after the set-up, with a traceback
        seq_len, block_size = cfg.data.get("seq_len"), cfg.model.get("block_size")
        if seq_len is not None and block_size is not None and seq_len > block_size:
            return [f"data.seq_len={seq_len} exceeds model.block_size={block_size}, the longest "
                    f"context the model is built for: lower data.seq_len or raise "
                    f"model.block_size"]
        return []


def register_configs() -> None:
    """Store the schemas under the names the YAML defaults lists use (safe to call again)."""
    from recipes import wide_deep_schema as wd  # it builds on the classes above

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="gpt_schema", node=GPTConfig)
    cs.store(group="model", name="hf_schema", node=HFModelConfig)
    cs.store(group="model", name="custom_schema", node=CustomModelConfig)
    cs.store(group="data", name="corpus_schema", node=CorpusConfig)
    cs.store(group="data", name="text_schema", node=TextDataConfig)
    cs.store(group="data", name="stream_schema", node=StreamDataConfig)
    cs.store(group="optim", name="adamw_schema", node=AdamWConfig)
    cs.store(group="optim", name="sgd_schema", node=SGDConfig)
    cs.store(group="hetero", name="hetero_schema", node=HeteroConfig)
    cs.store(group="offload", name="offload_schema", node=OffloadGroupConfig)
    cs.store(group="parallel", name="parallel_schema", node=ParallelGroupConfig)
    cs.store(name="wide_deep_schema", node=wd.WideDeepTrainConfig)
    cs.store(group="model", name="wide_deep_schema", node=wd.WideDeepModelConfig)
    cs.store(group="data", name="criteo_schema", node=wd.CriteoConfig)
    cs.store(group="sparse_optim", name="lazy_adam_schema", node=wd.LazyAdamConfig)
    cs.store(group="sparse_optim", name="ftrl_schema", node=wd.FTRLConfig)
