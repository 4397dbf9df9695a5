"""Which key of a weights file each of a model's tensors reads, checked before anything is
written.

A model's names are its *canonical* names (``parallel.weights.deferred_init.canonical_names``: a
tied alias such as ``lm_head.weight`` is the tensor it aliases, ``tok_emb.weight``), each with its
aliases: a file holding any alias of a tensor serves it — ``save_pretrained`` and safetensors'
``save_model`` keep one name of a tied pair and drop the other. The whole model's names and global
shapes are what is checked (recorded before a pipeline split or a shard), so every rank reaches the
same verdict without a collective:

* missing: a parameter or persistent buffer none of whose names is in the file (strict);
  non-persistent buffers (HF's rotary ``inv_freq``) are read when the file has them, else left
  to the model;
* unexpected: a file key that names no tensor of the model (strict);
* shape: a file tensor whose global shape is not the model's (always).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from parallel.weights.files import DcpWeights, WeightsSource, open_weights

#: how many problems an error message lists
_SHOWN = 5


@dataclasses.dataclass(frozen=True)
class ModelNames:
    """A whole model's tensor names, as recorded before any parallel step changes it."""

    #: every parameter/buffer name (tied aliases included) -> its canonical name
    canonical: dict[str, str]
    #: canonical name -> global shape
    shapes: dict[str, torch.Size]
    #: canonical names of non-persistent buffers (not in a state dict, so not required)
    optional: frozenset[str]

    def aliases(self) -> dict[str, list[str]]:
        """Canonical name -> all its names, the canonical one first."""
        groups: dict[str, list[str]] = {}
        for name, canonical in self.canonical.items():
            groups.setdefault(canonical, []).append(name)
        return groups


def model_names(model: nn.Module) -> ModelNames:
    """``model``'s :class:`ModelNames` (meta or real; a parallelized model gives its global
    DTensor shapes and only the tensors the rank holds)."""
    first: dict[int, str] = {}
    canonical: dict[str, str] = {}
    shapes: dict[str, torch.Size] = {}
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        canonical[name] = first.setdefault(id(tensor), name)
        shapes.setdefault(canonical[name], tensor.shape)
    optional = set()
    for path, module in model.named_modules(remove_duplicate=False):
        for leaf in module._non_persistent_buffers_set:
            name = f"{path}.{leaf}" if path else leaf
            if name in canonical:
                optional.add(canonical[name])
    return ModelNames(canonical, shapes, frozenset(optional))


@dataclasses.dataclass
class Weights:
    """A weights source matched to a model: which file key each canonical tensor reads."""

    source: WeightsSource
    #: canonical name -> the file key holding it
    keys: dict[str, str]


def _problem_list(problems: list[str]) -> str:
    shown = "; ".join(problems[:_SHOWN])
    more = len(problems) - _SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def match(names: ModelNames, source: WeightsSource, strict: bool = True,
          who: str = "weights") -> Weights:
    """Each canonical tensor's file key; ValueError naming the keys, the file and the rule for
    every missing or unexpected key (``strict``) and every shape mismatch, before anything is
    written."""
    if isinstance(source, DcpWeights):
        source.use_namespace(set(names.canonical))
    shapes = source.shapes()
    keys: dict[str, str] = {}
    missing, wrong = [], []
    for canonical, group in names.aliases().items():
        key = next((n for n in group if n in shapes), None)
        if key is None:
            if canonical not in names.optional:
                also = f" (also named {group[1:]})" if len(group) > 1 else ""
                missing.append(f"'{canonical}'{also}")
            continue
        if shapes[key] != names.shapes[canonical]:
            wrong.append(f"'{key}' is {tuple(shapes[key])} in {source.where(key)}, the model's "
                         f"'{canonical}' is {tuple(names.shapes[canonical])}")
            continue
        keys[canonical] = key
    unexpected = sorted(k for k in shapes if k not in names.canonical)
    if wrong:
        raise ValueError(f"{who}: shape mismatch: {_problem_list(wrong)}; a file tensor must "
                         f"have the model tensor's global shape (nothing was loaded)")
    if strict and missing:
        raise ValueError(f"{who}: missing key {_problem_list(missing)} in {source.path}: strict "
                         f"loading needs every parameter and persistent buffer of the model in "
                         f"the file (strict=False leaves them to the model: kept, or seeded on "
                         f"the meta device; nothing was loaded)")
    if strict and unexpected:
        shown = [f"'{k}' (in {source.where(k)})" for k in unexpected]
        raise ValueError(f"{who}: unexpected key {_problem_list(shown)}: strict loading needs "
                         f"every file tensor to name a tensor of the model (strict=False "
                         f"ignores them; nothing was loaded)")
    return Weights(source, keys)


def match_weights(model: nn.Module, path: str | Path, strict: bool = True,
                  who: str = "weights") -> Weights:
    """Open ``path`` (``parallel.weights.files.open_weights``) and match it to ``model``."""
    return match(model_names(model), open_weights(path), strict, who)
