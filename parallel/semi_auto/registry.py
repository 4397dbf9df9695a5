"""Which operators and module types ``parallel.shard`` knows, and the rule each one follows.

An operator maps to an ``OpRule`` of ``rules.py``. A module type maps to a ``ModuleRule``: the
same operator rule, with the module's parameters bound to some of its inputs (``nn.Linear``'s
weight is input 1) and settings read off the module (``nn.Softmax``'s dim).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallel.semi_auto.rules import (
    BINARY,
    BMM,
    EMBEDDING,
    LAYER_NORM,
    LINEAR,
    MATMUL,
    MM,
    RMS_NORM,
    SDPA,
    SOFTMAX,
    TRANSPOSED_LINEAR,
    UNARY,
    OpRule,
)

#: Callables ``parallel.shard`` accepts, with their rule. Dropout is absent on purpose: ranks
#: holding the same slice (repeated calculation) would draw different masks.
OP_RULES: dict[Any, OpRule] = {
    torch.matmul: MATMUL, torch.Tensor.matmul: MATMUL, operator.matmul: MATMUL,
    torch.bmm: BMM, torch.mm: MM, F.linear: LINEAR, F.embedding: EMBEDDING,
    F.softmax: SOFTMAX, torch.softmax: SOFTMAX, F.log_softmax: SOFTMAX,
    F.layer_norm: LAYER_NORM, F.rms_norm: RMS_NORM, F.scaled_dot_product_attention: SDPA,
    **dict.fromkeys([torch.add, torch.sub, torch.mul, torch.div, operator.add, operator.sub,
                     operator.mul, operator.truediv], BINARY),
    **dict.fromkeys([F.gelu, F.relu, F.silu, torch.relu, torch.tanh, torch.sigmoid, torch.exp,
                     F.tanh, F.sigmoid], UNARY),
}


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """A module type's rule: its forward's first argument is rule input 0, its parameters are
    the rule inputs named in ``params``, and ``info`` reads settings (softmax dim) off it."""

    rule: OpRule
    params: dict[str, int]
    info: Callable[[nn.Module], dict[str, Any]] = lambda module: {}


MODULE_RULES: dict[type, ModuleRule] = {
    nn.Linear: ModuleRule(LINEAR, {"weight": 1, "bias": 2}),
    nn.Embedding: ModuleRule(EMBEDDING, {"weight": 1}),
    nn.LayerNorm: ModuleRule(LAYER_NORM, {"weight": 1, "bias": 2},
                             lambda m: {"normalized_ndim": len(m.normalized_shape)}),
    nn.RMSNorm: ModuleRule(RMS_NORM, {"weight": 1},
                           lambda m: {"normalized_ndim": len(m.normalized_shape)}),
    nn.Softmax: ModuleRule(SOFTMAX, {}, lambda m: {"dim": m.dim}),
    nn.LogSoftmax: ModuleRule(SOFTMAX, {}, lambda m: {"dim": m.dim}),
    **dict.fromkeys([nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid], ModuleRule(UNARY, {})),
}


#: Module types of other libraries, by ``module.qualname``, so that the library need not be
#: installed (or imported) for the rule to exist: HuggingFace GPT-2's ``Conv1D`` computes
#: ``x @ weight + bias`` with its weight stored ``[in, out]`` (a column split is ``(1, mp)``).
NAMED_MODULE_RULES: dict[str, ModuleRule] = {
    "transformers.pytorch_utils.Conv1D": ModuleRule(TRANSPOSED_LINEAR, {"weight": 1, "bias": 2}),
}


#: Every HuggingFace decoder family defines its own RMSNorm class (``LlamaRMSNorm``,
#: ``Qwen2RMSNorm``, ``GemmaRMSNorm``, ...), each normalising the last dimension of its input
#: and scaling it by a 1-D ``weight``: one rule for all of them, found by name
HF_RMS_NORM = ModuleRule(RMS_NORM, {"weight": 1}, lambda m: {"normalized_ndim": 1})


def module_rule(module: nn.Module) -> ModuleRule | None:
    """The rule of ``module``'s type (or of the nearest base class that has one), or None."""
    for cls in type(module).__mro__:
        if cls in MODULE_RULES:
            return MODULE_RULES[cls]
        named = NAMED_MODULE_RULES.get(f"{cls.__module__}.{cls.__qualname__}")
        if named is not None:
            return named
        if cls.__module__.startswith("transformers.") and cls.__name__.endswith("RMSNorm") \
                and getattr(getattr(module, "weight", None), "ndim", None) == 1:
            return HF_RMS_NORM
    return None


def rule_names() -> str:
    """The module types with rules, for messages."""
    return ", ".join([f"nn.{c.__name__}" for c in MODULE_RULES] + list(NAMED_MODULE_RULES)
                     + ["transformers' *RMSNorm"])


def op_name(op: Any) -> str:
    """A readable name for a callable: torch.matmul, F.gelu, operator.add, Tensor.matmul."""
    name = getattr(op, "__name__", None)
    for prefix, namespace in (("F", F), ("torch", torch), ("operator", operator),
                              ("Tensor", torch.Tensor)):
        if name and getattr(namespace, name, None) is op:
            return f"{prefix}.{name}"
    return getattr(op, "__qualname__", None) or name or type(op).__name__
