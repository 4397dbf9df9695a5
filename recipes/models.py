"""The ``model`` group of the GPT recipe: which model a run trains, and what the other groups need
to know about it.

* ``model=gpt`` / ``gpt_moe``: the recipe's own GPT (``recipes/gpt.py``);
* ``model=hf``: a HuggingFace causal LM (``recipes/hf_model.py``);
* ``model=custom``: your class, ``model._target_`` (the contract is in docs/your-model.md).

Every model is sized to the data's tokenizer (``vocab_size``) and called ``model(idx, targets)``;
:func:`recipe_loss` takes the loss from whatever that returns. The other config
groups speak of the recipe GPT's modules by name; for the other models they are translated here:
``hetero.cpu_modules: [tok_emb]`` (``hetero=embedding_on_cpu``) names the model's input embedding
(``model.embed_tokens``, ``transformer.wte``), the GPT strategy files that ``parallel=semi_auto``
and ``parallel=auto`` default to become the shipped files of the HF model's family
(``conf/strategy/hf_*.yaml``), and ``trainer.recompute`` recomputes the model's layer list.

:func:`check_model_modes` refuses, by name and before any work starts, the modes a model cannot
train under.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch import nn

from parallel.config import OperatorSplit
from recipes import hf_model
from recipes.gpt import GPT
from recipes.parallel_mode import group_split

log = logging.getLogger(__name__)

#: the strategy files of the recipe GPT the parallel groups default to -> the HF file's suffix
GPT_STRATEGIES = {"gpt_megatron": "megatron", "gpt_mlp_columns": "auto"}
#: model_type -> the family of its shipped strategy files (conf/strategy/hf_<family>_*.yaml)
STRATEGY_FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                     "mixtral": "mixtral", "gpt2": "gpt2"}
#: model_types whose layers hold mixture-of-experts blocks HuggingFace's own way
HF_MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "dbrx", "olmoe", "granitemoe",
          "jamba", "phimoe", "gpt_oss", "llama4")


@dataclasses.dataclass
class BuiltModel:
    """The model and what the recipe needs to know about it."""

    model: nn.Module
    label: str  # for the log line
    layers: str | None  # fnmatch pattern of its layers (trainer.recompute), None: none found
    input_embedding: str | None  # path of the token embedding (hetero's "tok_emb")
    model_type: str | None = None  # an HF model's
    # whether its forward runs on fake tensors (the pipeline split measures and dry-runs it so);
    # HuggingFace's expert loop routes with data-dependent shapes, which they cannot hold
    fake_tensors: bool = True


def build_model(m: DictConfig, vocab_size: int) -> BuiltModel:
    """The model ``m`` (the ``model`` group) describes, sized to ``vocab_size``."""
    if m.name == "hf":
        model = hf_model.build_hf_model(m.path, _plain(m.config), vocab_size,
                                        m.attn_implementation, m.experts_implementation)
        positions = _max_positions(model.config)
        if positions is not None and m.block_size > positions:
            raise ValueError(f"model.block_size={m.block_size} exceeds the model's "
                             f"{positions} positions (max_position_embeddings)")
        model_type = model.config.model_type
        return BuiltModel(model, f"{type(model).__name__} (model=hf)", _layers(model),
                          hf_model.module_path(model, model.get_input_embeddings()),
                          model_type, fake_tensors=not _eager_experts(m, model_type))
    if m.name == "custom":
        model = build_custom_model(m._target_, _plain(m.kwargs) or {}, vocab_size)
        embedding = next((p for p, mod in model.named_modules() if isinstance(mod, nn.Embedding)),
                         None)
        return BuiltModel(model, f"{m._target_} (model=custom)", _layers(model), embedding)
    moe = (dict(num_experts=m.num_experts, top_k=m.top_k, capacity_factor=m.capacity_factor,
                aux_loss_factor=m.aux_loss_factor, dropless=m.dropless)
           if m.num_experts else None)
    model = GPT(vocab_size, m.d_model, m.n_layer, m.n_head, m.block_size, m.dropout, moe=moe,
                moe_every=m.moe_every)
    return BuiltModel(model, "GPT", "blocks.*", "tok_emb")


def _layers(model: nn.Module) -> str | None:
    """The fnmatch pattern of the model's layers (``trainer.recompute``), or None."""
    path = hf_model.layer_list_path(model)
    return f"{path}.*" if path else None


def _plain(node: Any) -> dict[str, Any] | None:
    return None if node is None else OmegaConf.to_container(node, resolve=True)


def _max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def hf_model_type(m: DictConfig) -> str | None:
    """The ``model_type`` of ``model=hf`` without building it (the inline config's, or the
    saved directory's ``config.json``); None for the other models."""
    if m.name != "hf":
        return None
    return _hf_setting(m, "model_type")


def _hf_setting(m: DictConfig, key: str) -> Any:
    """A setting of ``model=hf``'s config: the inline one's, or the saved ``config.json``'s."""
    return _hf_settings(m).get(key)


def _hf_settings(m: DictConfig) -> dict[str, Any]:
    """``model=hf``'s config settings: the inline ones, or the saved ``config.json``."""
    if m.config:
        return _plain(m.config) or {}
    path = hf_model.saved_model_dir(m.path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model.path={m.path}: cannot read {path}: {err}") from None


def _eager_experts(m: DictConfig, model_type: str | None) -> bool:
    """Whether the model routes tokens with HuggingFace's expert loop, whose data-dependent
    shapes fake tensors cannot hold (its pipeline split then goes by parameters)."""
    return model_type in HF_MOE and m.experts_implementation != "batched_mm"


def check_model_modes(cfg: DictConfig) -> None:
    """ValueError naming the setting, for a model the configured parallel mode cannot train (run
    before any process group, data or model exists)."""
    m, p = cfg.model, cfg.parallel
    if m.name not in ("hf", "custom"):
        return
    model_type = hf_model_type(m)
    what = f"model=hf ({model_type})" if m.name == "hf" else f"model=custom ({m._target_})"
    expert = p.get("expert_degree") or p.get("expert") or 1
    if m.name == "hf" and expert > 1:
        reason = (f"{model_type} keeps its experts in HuggingFace's own module, which expert "
                  f"parallel cannot shard" if model_type in HF_MOE else
                  "it has no mixture-of-experts layers")
        raise ValueError(f"parallel.expert_degree={expert} shards the experts of parallel.nn.MoE "
                         f"layers, and {what} has none: {reason}. Train it with "
                         f"parallel=data, semi_auto, pipeline or optimizer parallel (experts "
                         f"replicated like any weight)")
    if m.name == "hf" and group_split(p) is OperatorSplit.MODEL:
        raise ValueError(f"parallel.tensor_degree={p.tensor_degree} without a strategy file or a "
                         f"search asks the model to split itself with its own tensor-parallel "
                         f"collectives (hybrid parallel); {what} does not. Use parallel=semi_auto "
                         f"(DTensor inserts them) or parallel=data")
    if m.name == "hf" and p.get("multi_copy", 1) > 1:
        raise ValueError(f"parallel.multi_copy={p.multi_copy} interleaves copies of the batch "
                         f"through the model's forward traced with torch.fx, which cannot trace "
                         f"HuggingFace's forward (it branches on tensor values); leave "
                         f"parallel.multi_copy at 1 with model=hf")
    pipeline = (p.get("pipeline_degree") or p.get("pipeline") or 1) > 1
    if m.name == "hf" and pipeline:
        why = hf_model.family_split_error(json.dumps(_hf_settings(m), sort_keys=True),
                                          fake_tensors=not _eager_experts(m, model_type))
        if why is not None:
            raise ValueError(f"pipeline stages (parallel.pipeline_degree > 1) of model=hf run "
                             f"HuggingFace's decoder forward on part of the layers, checked on "
                             f"a small model of the family; for model_type {model_type!r} "
                             f"{why}. Train it with parallel=data, semi_auto or optimizer "
                             f"parallel")
        if _hf_setting(m, "output_router_logits"):
            raise ValueError("model.config.output_router_logits=true adds the router's balancing "
                             "loss inside HuggingFace's forward, which pipeline stages do not "
                             "run whole (the last stage's loss comes from the logits); turn it "
                             "off or train without pipeline stages")
    spmd = group_split(p) in (OperatorSplit.STRATEGIES, OperatorSplit.SEARCH)
    if spmd and model_type in HF_MOE and m.experts_implementation != "batched_mm":
        raise ValueError(f"parallel={p.name} runs {what} on DTensors, and HuggingFace's expert "
                         f"loop (model.experts_implementation={m.experts_implementation}) routes "
                         f"tokens with torch.nonzero, which DTensor cannot shard. "
                         f"model.experts_implementation=batched_mm runs there (it gathers each "
                         f"token's expert weights: memory grows with tokens x expert size), or "
                         f"train with parallel=data, pipeline or optimizer parallel")
    if spmd and p.strategy in GPT_STRATEGIES and (m.name == "custom"
                                                  or model_type not in STRATEGY_FAMILIES):
        raise ValueError(f"parallel.strategy={p.strategy} shards the recipe GPT's modules; "
                         f"{what} needs a strategy file of its own module paths: "
                         f"parallel.strategy=path/to/file.yaml (conf/strategy/ holds files for "
                         f"the HuggingFace families {sorted(set(STRATEGY_FAMILIES.values()))})")


def parallel_group_for(p: DictConfig, built: BuiltModel) -> DictConfig:
    """The ``parallel`` group with the recipe GPT's default strategy file replaced by the HF
    family's (``conf/strategy/hf_<family>_<layout>.yaml``), said in the log; else unchanged."""
    if built.model_type is None or p.get("strategy") not in GPT_STRATEGIES:
        return p
    if group_split(p) not in (OperatorSplit.STRATEGIES, OperatorSplit.SEARCH):
        return p
    family = STRATEGY_FAMILIES[built.model_type]
    name = f"hf_{family}_{GPT_STRATEGIES[p.strategy]}"
    log.info("parallel.strategy: %s shards the recipe GPT; %s uses conf/strategy/%s.yaml",
             p.strategy, built.label, name)
    p = p.copy()
    p.strategy = name
    return p


def hetero_group_for(h: DictConfig, built: BuiltModel) -> DictConfig:
    """The ``hetero`` group with ``tok_emb`` (the recipe GPT's token embedding, which
    ``hetero=embedding_on_cpu`` names) read as the model's own input embedding."""
    if "tok_emb" not in h.cpu_modules or built.input_embedding in (None, "tok_emb"):
        return h
    if "tok_emb" in dict(built.model.named_modules()):
        return h
    h = h.copy()
    h.cpu_modules = [built.input_embedding if p == "tok_emb" else p for p in h.cpu_modules]
    log.info("hetero.cpu_modules: tok_emb is %s's input embedding, %s", built.label,
             built.input_embedding)
    return h


def build_custom_model(target: str, kwargs: Mapping[str, Any], vocab_size: int
                       ) -> nn.Module:
    """``model._target_``: the user's class built with ``model.kwargs`` (plus
    ``vocab_size``, the tokenizer's, when the constructor takes it and the kwargs do not)."""
    try:
        cls = get_class(target)
    except Exception as err:  # hydra wraps the import error
        raise ValueError(f"model._target_={target}: cannot import it ({err})") from None
    args = dict(kwargs)
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "vocab_size" not in args and ("vocab_size" in params or takes_any):
        args["vocab_size"] = vocab_size
    model = cls(**args)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model._target_={target} built a {type(model).__name__}, not an "
                         f"nn.Module")
    return model


def recipe_loss(output: Any, targets: torch.Tensor,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The loss from what a model's ``forward(idx, targets)`` returned: ``(logits, loss)``, the
    loss itself (a scalar), or logits (then ``loss_fn(logits, targets)``)."""
    if isinstance(output, (tuple, list)):
        output = output[1] if len(output) > 1 and output[1] is not None else output[0]
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"the model's forward(idx, targets) returned {type(output).__name__}; "
                        f"it must return the loss, the logits, or (logits, loss)")
    return output if output.dim() == 0 else loss_fn(output, targets)
