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
that runs with other stages' parts missing. For the layouts known here (:data:`LAYOUTS`: the
Llama family's ``model.embed_tokens / model.layers / model.norm`` and GPT-2's
``transformer.wte, wpe / transformer.h / transformer.ln_f``) a stage runs HuggingFace's own
decoder forward on its layers, fed ``inputs_embeds`` (the previous stage's hidden state) when it
lacks the token embedding, with stand-ins for the parts it lacks around the layers (the final
norm is an identity before the last stage, GPT-2's position embedding adds nothing after the
first, the rotary embedding, which holds no weights, is a copy on every stage); it returns the
hidden state, or the logits on the stage holding the head, whose loss is then computed from the
logits (``recipes.gpt.lm_loss``: the same mean cross-entropy).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
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


_DECODER = Layout("model", "embed_tokens", "layers",
                  {"norm": "identity", "rotary_emb": "copy"})
_GPT2 = Layout("transformer", "wte", "h", {"wpe": "zeros", "drop": "identity", "ln_f": "identity"})

#: model_type -> layout, for the families whose decoder forward is embed -> layers -> norm with
#: nothing else between (pipeline stages; a family outside it is refused by name there)
LAYOUTS: dict[str, Layout] = {
    "llama": _DECODER, "mistral": _DECODER, "qwen2": _DECODER, "qwen3": _DECODER,
    "mixtral": _DECODER, "gpt2": _GPT2,
}


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
                **hf_kwargs: Any) -> Any:
        if hf_kwargs:  # called the HuggingFace way
            if idx is not None:
                hf_kwargs["input_ids"] = idx
            if targets is not None:
                hf_kwargs["labels"] = targets
            return super().forward(**hf_kwargs)
        if not _is_stage(self):
            if targets is not None:  # HF's loss views them flat
                targets = targets.contiguous()
            kwargs = {} if targets is None else {"labels": targets, "shift_labels": targets}
            out = super().forward(input_ids=idx, **kwargs)
            return out.logits, out.loss
        return _stage_forward(self, idx)


def _layout(model: nn.Module) -> Layout | None:
    return LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))


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


def _stage_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage: HuggingFace's decoder forward over this stage's layers (see the
    module docstring); the hidden state, or the logits on the stage holding the head."""
    layout = _layout(model)
    if layout is None:
        raise ValueError(f"{type(model).__name__} (model_type {model.config.model_type!r}) runs "
                         f"as a pipeline stage only for the families {sorted(LAYOUTS)}")
    base = getattr(model, layout.base)
    kept = model.__dict__["_recipe_stand_ins"]
    stand_ins = {name: kept[name] for name in layout.stand_ins if base._modules[name] is None}
    for stand_in in stand_ins.values():  # made before the model moved to its device
        stand_in.to(x.device)
    with _standing_in(base, stand_ins):
        if getattr(base, layout.embed) is not None:
            hidden = base(input_ids=x).last_hidden_state
        else:
            hidden = base(inputs_embeds=x).last_hidden_state
    head = model._modules.get("lm_head")
    return head(hidden) if head is not None else hidden


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
    layout = _layout(model)
    model.__dict__["_recipe_stand_ins"] = _stand_ins(model, layout) if layout else {}
    return model


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
