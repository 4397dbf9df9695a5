"""``model=hf``: any HuggingFace ``transformers`` causal LM in the GPT recipe.

The model comes from a local ``save_pretrained`` directory (``model.path``) or from a config given
inline (``model.config={model_type: llama, hidden_size: 64, ...}``: random init from the recipe's
seed). Nothing is downloaded: a path that is not a local directory is refused, and
``from_pretrained`` runs with ``local_files_only``.

The built model keeps its own class and module names (``model.layers.3.mlp.up_proj``,
``transformer.h.0.attn.c_attn``), so strategy files, ``hetero.cpu_modules``, checkpoints and
``save_pretrained`` all use HuggingFace's names. Its class is swapped for a subclass that adds the
recipe's calling convention (as torch's FSDP2 ``fully_shard`` swaps a module's class to add its
own): ``model(idx, targets)`` returns ``(logits, loss)``, where the loss is HuggingFace's own
``.loss`` (``labels=targets`` with ``shift_labels=targets``: the recipe's targets are already the
next tokens, so nothing is shifted twice). Called the HuggingFace way (keyword arguments, e.g. by
``generate``), the model behaves as before.

Pipeline stages (``parallel/pipeline``: module deletion, torchtitan's convention) need a forward
that runs with other stages' parts missing. The model's :class:`Layout` is read from its structure
(:func:`derive_layout`: the decoder is ``base_model_prefix``, the token embedding is
``get_input_embeddings()``, the layer list is the ``nn.ModuleList`` of ``num_hidden_layers``
layers, and every other part of the decoder gets a stand-in: a weighted one, a final norm, is an
identity on a stage without it, a second embedding (GPT-2's positions) adds zeros, a weightless
one holding buffers (the rotary embedding) is a copy on every stage, any other (dropout) an
identity), not from a list of families. A stage runs HuggingFace's own decoder forward on its
layers, fed ``inputs_embeds`` (the previous stage's hidden state) when it lacks the token
embedding; it returns the hidden state, or the logits on the stage holding the head, whose loss
is then computed from the logits (``recipes.gpt.lm_loss``: the same mean cross-entropy).

Whether that reproduces a family's forward is checked, not assumed (:func:`stage_split_error`):
a 2-layer model of the family is split into two stages by the pipeline's own units and carving,
and the stages' logits must equal the whole model's bit for bit. A family whose forward does
more than embed -> layers -> norm -> head, and the logit settings :func:`_after_head` applies
(Gemma 2's soft-cap, Cohere's and Granite's scales), fails the check and is refused by name, with
the difference measured (XGLM scales its embeddings inside the decoder's forward, so a later
stage would scale its input again).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a family keeps its parts: the decoder module (``base``) and, in it, the token
    embedding, the layer list, and the parts that need a stand-in on a stage that lacks them."""

    base: str  # the decoder's attribute on the causal LM
    embed: str  # the token embedding's attribute on the decoder
    layers: str  # the layer list's attribute on the decoder
    stand_ins: Mapping[str, str]  # decoder attribute -> "identity" | "zeros" | "copy"


def derive_layout(model: nn.Module) -> Layout | None:
    """``model``'s layout read from its structure (module docstring), or None when it has no
    decoder holding both its token embedding and a list of ``num_hidden_layers`` layers."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layer_count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if not isinstance(base, nn.Module) or not hasattr(model, "get_input_embeddings"):
        return None
    children = dict(base.named_children())
    embed = next((name for name, child in children.items()
                  if child is model.get_input_embeddings()), None)
    layers = next((name for name, child in children.items()
                   if isinstance(child, nn.ModuleList) and len(child) == layer_count), None)
    if embed is None or layers is None:
        return None
    stand_ins = {}
    for name, child in children.items():
        if name in (embed, layers):
            continue
        if any(True for _ in child.parameters()):
            stand_ins[name] = "zeros" if isinstance(child, nn.Embedding) else "identity"
        else:
            stand_ins[name] = "copy" if any(True for _ in child.buffers()) else "identity"
    return Layout(model.base_model_prefix, embed, layers, stand_ins)


class _Zeros(nn.Module):
    """GPT-2's position embedding on a stage after the first: the hidden state already holds it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=positions.device).expand(*positions.shape, self.width)


class RecipeCausalLM:
    """The recipe's calling convention on a HuggingFace causal LM (a mixin placed first in the
    model's swapped class; see the module docstring)."""

    def forward(self, idx: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **hf_kwargs: Any) -> Any:
        if position_ids is not None and idx is not None and not hf_kwargs:
            # the tokens' places (context parallel's share); an all-ones mask, or HuggingFace
            # reads a jump in the positions as packed sequences and masks across it
            mask = torch.ones(idx.shape[:2], dtype=torch.long, device=idx.device)
            return self._recipe_call(idx, targets, {"position_ids": position_ids,
                                                    "attention_mask": mask})
        if position_ids is not None:
            hf_kwargs["position_ids"] = position_ids
        if hf_kwargs:  # called the HuggingFace way
            if idx is not None:
                hf_kwargs["input_ids"] = idx
            if targets is not None:
                hf_kwargs["labels"] = targets
            return super().forward(**hf_kwargs)
        return self._recipe_call(idx, targets, {})

    def _recipe_call(self, idx: torch.Tensor | None, targets: torch.Tensor | None,
                     hf_kwargs: dict[str, Any]) -> Any:
        if not _is_stage(self):
            if targets is not None:  # HF's loss views them flat
                targets = targets.contiguous()
            kwargs = {} if targets is None else {"labels": targets, "shift_labels": targets}
            out = super().forward(input_ids=idx, **kwargs, **hf_kwargs)  # type: ignore[misc]
            return out.logits, out.loss
        return _stage_forward(self, idx, hf_kwargs)


def _layout(model: nn.Module) -> Layout | None:
    """The layout :func:`adopt` read from the whole model (a stage lacks parts to read it)."""
    return model.__dict__.get("_recipe_layout")


def _is_stage(model: nn.Module) -> bool:
    """Whether a pipeline split removed parts of ``model`` (it then runs as one stage)."""
    base = getattr(model, model.base_model_prefix, None)
    if model._modules.get("lm_head", True) is None or base is None:
        return True
    if any(child is None for child in base._modules.values()):
        return True
    layout = _layout(model)
    layers = getattr(base, layout.layers) if layout else None
    return layers is not None and len(layers) < model.config.num_hidden_layers


@contextlib.contextmanager
def _standing_in(module: nn.Module, stand_ins: dict[str, nn.Module]) -> Iterator[None]:
    """``module``'s missing children replaced by ``stand_ins`` while the block runs."""
    for name, stand_in in stand_ins.items():
        module._modules[name] = stand_in
    try:
        yield
    finally:
        for name in stand_ins:
            module._modules[name] = None


def _stage_forward(model: nn.Module, x: torch.Tensor, hf_kwargs: dict[str, Any]
                   ) -> torch.Tensor:
    """One pipeline stage: HuggingFace's decoder forward over this stage's layers (see the
    module docstring); the hidden state, or the logits on the stage holding the head.
    ``hf_kwargs``: the tokens' ``position_ids`` and mask (a context split's share), or none."""
    layout = _layout(model)
    if layout is None:
        raise ValueError(f"{type(model).__name__} (model_type {model.config.model_type!r}) has "
                         f"no decoder holding its token embedding and a list of its "
                         f"{model.config.num_hidden_layers} layers, so it cannot run as a "
                         f"pipeline stage")
    base = getattr(model, layout.base)
    kept = model.__dict__["_recipe_stand_ins"]
    stand_ins = {name: kept[name] for name in layout.stand_ins if base._modules[name] is None}
    for stand_in in stand_ins.values():  # made before the model moved to its device
        stand_in.to(x.device)
    with _standing_in(base, stand_ins):
        if getattr(base, layout.embed) is not None:
            hidden = base(input_ids=x, **hf_kwargs).last_hidden_state
        else:
            hidden = base(inputs_embeds=x, **hf_kwargs).last_hidden_state
    head = model._modules.get("lm_head")
    return _after_head(model.config, head(hidden)) if head is not None else hidden


def _after_head(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """What a causal LM's own forward does to the head's output, by the config settings that
    ask for it (each family's forward applies them in this form): Cohere's ``logit_scale``,
    Granite's ``logits_scaling``, Gemma 2's ``final_logit_softcapping``. Whether a family's
    stages then compute its forward is :func:`stage_split_error`'s to check."""
    scale = getattr(config, "logit_scale", None)
    if scale is not None:
        logits = logits * scale
    divisor = getattr(config, "logits_scaling", None)
    if divisor is not None:
        logits = logits / divisor
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _stand_ins(model: nn.Module, layout: Layout) -> dict[str, nn.Module]:
    base = getattr(model, layout.base)
    made: dict[str, nn.Module] = {}
    for name, kind in layout.stand_ins.items():
        part = getattr(base, name, None)
        if kind == "identity":
            made[name] = nn.Identity()
        elif kind == "zeros":
            made[name] = _Zeros(part.embedding_dim)
        elif part is not None:  # a copy of a weightless part (rotary): buffers only
            made[name] = copy.deepcopy(part)
    return made


_ADOPTED: dict[type, type] = {}


def adopt(model: nn.Module) -> nn.Module:
    """``model`` (a HuggingFace causal LM) with the recipe's calling convention, in place: its
    class becomes a subclass of its own class (same name) with :class:`RecipeCausalLM` first;
    ``config.use_cache`` is turned off (training does not read the key/value cache)."""
    cls = type(model)
    if not isinstance(model, RecipeCausalLM):
        if cls not in _ADOPTED:
            _ADOPTED[cls] = type(cls.__name__, (RecipeCausalLM, cls),
                                 {"__module__": __name__, "__qualname__": cls.__qualname__})
        model.__class__ = _ADOPTED[cls]
    model.config.use_cache = False
    layout = derive_layout(model)
    model.__dict__["_recipe_layout"] = layout
    model.__dict__["_recipe_stand_ins"] = _stand_ins(model, layout) if layout else {}
    return model


def stage_split_error(model: nn.Module, fake_tensors: bool = True) -> str | None:
    """Why pipeline stages of ``model`` (an adopted causal LM) would not compute its forward, or
    None when they do: a short random sequence through two stages (cut at the middle layer by
    the pipeline's own units and carving) gives the whole model's logits bit for bit (the same
    kernels run in the same order), or the difference. ``fake_tensors=False``: the units in
    registration order, as the split takes them for a forward fake tensors cannot run."""
    from parallel.pipeline.carve import carve
    from parallel.pipeline.partition import measure_units, unit_paths

    layout = _layout(model)
    if layout is None:
        return (f"it has no decoder holding its token embedding and a list of its "
                f"{model.config.num_hidden_layers} layers")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (1, 8), generator=generator)
    training = model.training
    model.eval()  # dropout off: both sides compute the same function
    try:
        with torch.no_grad():
            want = model(ids)[0]
            paths = unit_paths(model)
            order = [unit.path for unit in measure_units(model, paths,
                                                         (ids,) if fake_tensors else None)]
            layers = getattr(getattr(model, layout.base), layout.layers)
            cut = order.index(f"{layout.base}.{layout.layers}.{len(layers) // 2}")
            first, second = (carve(model, set(keep), set(paths), in_place=False)
                             for keep in (order[:cut], order[cut:]))
            try:
                got = second(first(ids))
            except Exception as err:  # the family's forward needs what a stage lacks
                return (f"two stages of a 2-layer {model.config.model_type} cannot run its "
                        f"forward ({type(err).__name__}: {err})")
    finally:
        model.train(training)
    if got.shape != want.shape or not torch.equal(got, want):
        diff = (got - want).abs().max().item() if got.shape == want.shape else got.shape
        return (f"two stages of a 2-layer {model.config.model_type} do not compute its forward "
                f"(largest difference {diff:.3g}): its forward does more than embed -> layers -> "
                f"norm -> head")
    return None


#: a family's stage check runs on this small a model (its width settings, where they are larger)
_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16}


@functools.lru_cache(maxsize=16)
def family_split_error(settings_json: str, fake_tensors: bool) -> str | None:
    """:func:`stage_split_error` for the family and settings of a model config (its JSON, as
    ``config.json`` or ``model.config`` give it), on a 2-layer model of that family made small
    (so a check before any model exists costs well under a second); the settings' own width
    when the family refuses the small one."""
    settings = {key: value for key, value in json.loads(settings_json).items()
                if key not in ("architectures", "auto_map", "torch_dtype", "dtype",
                               "transformers_version")}
    settings.update(num_hidden_layers=2)
    vocab = min(int(settings.get("vocab_size") or 256), 256)
    settings["vocab_size"] = vocab
    small = {**settings, **{k: v for k, v in _SMALL.items()
                            if isinstance(settings.get(k), int) and settings[k] > v}}
    seed = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        try:  # a family may tie its widths together (a rotary dimension, a head size) ...
            return stage_split_error(build_hf_model(None, small, vocab), fake_tensors)
        except (ValueError, TypeError, AttributeError, RuntimeError):
            pass  # ... that the small model breaks: the config's own widths then
        return stage_split_error(build_hf_model(None, settings, vocab), fake_tensors)
    finally:
        torch.random.set_rng_state(seed)


def layer_list_path(model: nn.Module) -> str | None:
    """The dotted path of the model's layer list (``model.layers``, ``transformer.h``; for
    another model its first non-empty ``nn.ModuleList``), or None."""
    layout = _layout(model)
    if layout is not None:
        return f"{layout.base}.{layout.layers}"
    return next((path for path, module in model.named_modules()
                 if isinstance(module, nn.ModuleList) and len(module)), None)


def module_path(model: nn.Module, target: nn.Module) -> str:
    """The dotted path of ``target`` in ``model``."""
    return next(path for path, module in model.named_modules() if module is target)


def build_hf_model(path: str | None, config: Mapping[str, Any] | None, vocab_size: int,
                   attn_implementation: str | None = None,
                   experts_implementation: str | None = "eager") -> nn.Module:
    """The causal LM ``model.path`` or ``model.config`` describes, adopted (:func:`adopt`).
    ``vocab_size`` is the tokenizer's: an inline config gets it (unless it sets a larger one),
    a saved model must have at least that many rows. Random init uses torch's current seed."""
    import transformers

    extra = {key: value for key, value in (("attn_implementation", attn_implementation),
                                           ("experts_implementation", experts_implementation))
             if value is not None}
    if path is not None:
        where = saved_model_dir(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            where, local_files_only=True, trust_remote_code=False, dtype=torch.float32,
            **extra)
        if model.config.vocab_size < vocab_size:
            raise ValueError(f"model.path={path} has vocab_size={model.config.vocab_size}, but the "
                             f"data's tokenizer has {vocab_size} tokens; use the model's own "
                             f"tokenizer (data=text data.tokenizer=DIR) or a model with as "
                             f"many rows")
    else:
        settings = dict(config or {})
        model_type = settings.pop("model_type", None)
        if model_type is None:
            raise ValueError("model=hf needs model.path=DIR (a save_pretrained directory) or "
                             "model.config={model_type: llama, ...} (a config given inline)")
        given = settings.get("vocab_size")
        if given is not None and given < vocab_size:
            raise ValueError(f"model.config.vocab_size={given} is smaller than the data's "
                             f"tokenizer ({vocab_size} tokens); leave it out to take the "
                             f"tokenizer's")
        settings.setdefault("vocab_size", vocab_size)
        try:
            defaults = transformers.AutoConfig.for_model(model_type)
            settings.update(_foreign_token_ids(defaults, settings))
            hf_config = transformers.AutoConfig.for_model(model_type, **settings)
        except (KeyError, ValueError) as err:
            first = str(err).split(". Should contain")[0]  # not transformers' list of every type
            raise ValueError(f"model.config: {first}") from None
        if type(hf_config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(f"model.config.model_type={model_type!r} has no causal-LM class in "
                             f"transformers (AutoModelForCausalLM); model=hf trains causal LMs")
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                              **extra)
    return adopt(model)


def saved_model_dir(path: str) -> Path:
    """``model.path`` as a local ``save_pretrained`` directory, or ValueError (nothing is
    downloaded: a hub name is not a directory here)."""
    where = Path(path).expanduser()
    if not (where / "config.json").is_file():
        raise ValueError(f"model.path={path}: not a local save_pretrained directory (no "
                         f"config.json there); the recipe does not download models: save one "
                         f"with model.save_pretrained(DIR) (or huggingface-cli download) and "
                         f"pass DIR")
    return where


def _foreign_token_ids(defaults: Any, given: Mapping[str, Any]) -> dict[str, None]:
    """Special token ids a family defaults to (GPT-2's 50256) that fall outside the vocabulary
    ``given`` sizes (the data's): unset, since they name no token the data has."""
    return {key: None for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            if key not in given and isinstance(getattr(defaults, key, None), int)
            and getattr(defaults, key) >= given["vocab_size"]}
