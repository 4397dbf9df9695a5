"""A checkpoint as a HuggingFace directory (``config.json`` + ``model.safetensors``), loadable
with ``transformers``' ``from_pretrained``.

What it becomes depends on what the checkpoint's saved config says it holds:

* a transformers model (``model=hf`` runs; the checkpoint's ``hf_config.json``, else the run
  config's ``model.path`` / ``model.config``): that model's own ``save_pretrained`` layout — the
  model is built from its config on the meta device, the checkpoint's tensors are assigned to it
  under the model's own names (a wrapper's prefix removed when that makes them match exactly),
  tied weights are re-tied, and transformers writes the directory;
* the recipe's GPT: the equivalent GPT-2 (``recipes/export_gpt2.py``), or a refusal naming why
  GPT-2 cannot express it;
* anything else (Wide&Deep): refused by name, with the single-file formats as the way out.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from recipes.checkpoint import TOKENIZER_FILE
from recipes.checkpoint_integrity import CheckpointError
from recipes.export_gpt2 import NotGPT2Error, gpt2_config_kwargs, gpt2_state_dict
from recipes.export_state import CheckpointModel

log = logging.getLogger(__name__)

#: ``model.name`` of the recipe's own GPT configs
GPT_MODELS = ("gpt", "gpt_moe")


def _hf_config(ckpt: CheckpointModel) -> Any | None:
    """The transformers config of a checkpoint that holds a transformers model, else None."""
    from transformers import AutoConfig

    if ckpt.hf_config is not None:
        fields = dict(ckpt.hf_config)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = ckpt.config.get("model") if ckpt.config is not None else None
    if model is None or model.get("name") != "hf":
        return None
    if model.get("path"):
        return AutoConfig.from_pretrained(model.path, local_files_only=True,
                                          trust_remote_code=False)
    if model.get("config"):
        fields = dict(model.config)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    raise NotGPT2Error(f"--to hf: {ckpt.path} was written by a model=hf run whose config gives "
                       f"neither model.path nor model.config, so the model's config is unknown")


def _matching_names(state: dict[str, torch.Tensor], wanted: set[str],
                    tied: set[str]) -> dict[str, torch.Tensor]:
    """``state`` under the names of ``wanted``: as it is, or with the one prefix (``model.``,
    ``hf.``, ...) a recipe wrapper added to every name removed; CheckpointError naming the
    differences when neither fits. Names in ``tied`` may be absent (they are re-tied)."""
    first = next(iter(state))
    parts = first.split(".")
    for prefix in ["", *(".".join(parts[:i]) + "." for i in range(1, min(3, len(parts))))]:
        if not all(k.startswith(prefix) for k in state):
            continue
        names = {k[len(prefix):]: t for k, t in state.items()}
        if set(names) <= wanted and not (wanted - set(names) - tied):
            return names
    missing, extra = sorted(wanted - set(state) - tied), sorted(set(state) - wanted)
    raise CheckpointError(f"--to hf: the checkpoint's parameters do not match the model its "
                          f"config describes (missing: {missing[:8]}, unexpected: {extra[:8]})")


def _save(model: torch.nn.Module, state: dict[str, torch.Tensor], out: Path) -> Path:
    """Assign ``state`` to the meta-device ``model`` (strict), re-tie, ``save_pretrained``."""
    tied = set(getattr(model, "_tied_weights_keys", None) or ())  # a dict (v5) or a list
    names = _matching_names(state, set(model.state_dict()), tied)
    missing, unexpected = model.load_state_dict(names, strict=False, assign=True)
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"--to hf: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    still_meta = [n for n, p in model.state_dict().items() if p.is_meta]
    if still_meta:
        raise CheckpointError(f"--to hf: no value in the checkpoint for {still_meta[:8]}")
    model.save_pretrained(out)
    return out


def export_hf(ckpt: CheckpointModel, out: Path) -> Path:
    """Write ``ckpt``'s model as a HuggingFace directory at ``out``, with the run's tokenizer
    when the checkpoint holds it; see the module doc."""
    _export_model(ckpt, out)
    tokenizer = ckpt.path / TOKENIZER_FILE
    if tokenizer.is_file():  # AutoTokenizer.from_pretrained(out) then encodes as the run did
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_file=str(tokenizer)).save_pretrained(out)
    else:
        log.warning("%s holds no %s (written by an older version): the export has no "
                    "tokenizer", ckpt.path, TOKENIZER_FILE)
    return out


def _export_model(ckpt: CheckpointModel, out: Path) -> Path:
    try:
        from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
    except ImportError as err:
        raise SystemExit("recipes.export --to hf needs the transformers library: "
                         "pip install -c constraints.txt -e '.[hf]'") from err

    config = _hf_config(ckpt)
    if config is not None:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        log.info("transformers model %s: writing its own save_pretrained layout",
                 type(model).__name__)
        return _save(model, ckpt.state, out)
    model_cfg = ckpt.config.get("model") if ckpt.config is not None else None
    if model_cfg is None:
        raise NotGPT2Error(f"--to hf: {ckpt.path} has no config.yaml and no .hydra/config.yaml "
                           f"above it, so which model it holds is unknown; use --to safetensors "
                           f"or --to torch")
    if model_cfg.get("name") not in GPT_MODELS:
        raise NotGPT2Error(f"--to hf: model={model_cfg.get('name')} is not a transformers "
                           f"model and has no transformers equivalent; use --to safetensors or "
                           f"--to torch")
    config = GPT2Config(**gpt2_config_kwargs(model_cfg, ckpt.state))
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    log.info("the recipe's GPT as GPT-2 (%d layers, d_model %d)", config.n_layer, config.n_embd)
    return _save(model, gpt2_state_dict(ckpt.state, config.n_layer), out)
