"""Per-operator sharding rules: which inputs a strategy covers and how their dimensions relate.

Each rule names every dimension of every tensor input with a letter, einsum-style; a letter that
appears in several inputs is the same dimension and must be sliced the same way (MatMul's
contracting ``k``), a letter missing from the output is summed over (a split ``k`` leaves partial
sums), and some letters may not be split at all (softmax's axis, layer norm's normalized
dimensions, attention's sequence and head dimensions). ``parallel.semi_auto.strategy`` turns a
rule plus a strategy into layouts; this module only describes the operators. The reference's
OperatorInfo classes do this per operator in C++; DTensor's ``_ops`` rules enumerate placements
instead of deriving them from a user strategy, so neither can be reused for this step.

``local`` says whether each rank may run the plain operator on its own slices (true for these
label rules, except an embedding whose table rows are split: that goes through DTensor's own
masked lookup).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

_UPPER = string.ascii_uppercase  # leading (batch-like) dimensions; rule letters are lowercase


@dataclasses.dataclass(frozen=True)
class Labels:
    """Dimension letters of each tensor input and of the output."""

    inputs: tuple[str, ...]
    output: str
    unsplit: dict[str, str] = dataclasses.field(default_factory=dict)  # letter -> why not
    broadcast: frozenset[str] = frozenset()  # letters whose slices may differ as 1 vs k


@dataclasses.dataclass(frozen=True)
class OpRule:
    """How a strategy applies to one operator (see the module docstring).

    ``slots`` says where each tensor input sits in a call: (position, keyword). ``info`` reads
    the non-tensor settings a rule depends on (softmax's dim) off the call, and rejects calls the
    rule cannot shard.
    """

    name: str
    input_names: tuple[str, ...]
    arity: tuple[int, ...] | None  # accepted numbers of strategy entries; None: 1..len(inputs)
    slots: tuple[tuple[int, str], ...]
    labels: Callable[[tuple[int, ...], dict[str, Any]], Labels]
    info: Callable[[tuple, dict], dict[str, Any]] = lambda args, kwargs: {}
    local: Callable[[dict[str, int]], bool] = lambda slices: True

    def accepts(self, count: int) -> bool:
        if self.arity is None:
            return 1 <= count <= len(self.input_names)
        return count in self.arity

    def bind(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's tensor inputs in rule order (None where absent or not a tensor)."""
        found = [_get(args, kwargs, pos, name) for pos, name in self.slots]
        return [v if isinstance(v, (torch.Tensor, fx.Node, fx.Proxy)) else None for v in found]

    def substitute(self, args: tuple, kwargs: dict, values: Sequence[Any]) -> tuple[tuple, dict]:
        """``args``/``kwargs`` with the tensor inputs replaced by ``values`` (None: unchanged)."""
        args, kwargs = list(args), dict(kwargs)
        for (pos, name), value in zip(self.slots, values, strict=False):
            if value is None:
                continue
            if len(args) > pos:
                args[pos] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs


def _get(args: tuple, kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ----------------------------------------------------------------------------- matrix products


def _matmul_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    p, q = ranks[0], ranks[1]
    _need(p >= 2 and q >= 2, f"matmul strategies need at least 2 dimensions per input, got "
                             f"{p} and {q}")
    n = max(p, q) - 2
    batch = _UPPER[:n]
    return Labels((batch[n - (p - 2):] + "ik", batch[n - (q - 2):] + "kj"), batch + "ij",
                  broadcast=frozenset(batch))


def _bmm_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    _need(ranks[:2] == (3, 3), f"bmm strategies have 3 entries per input, got {ranks[:2]}")
    return Labels(("bik", "bkj"), "bij")


def _mm_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    _need(ranks[:2] == (2, 2), f"mm strategies have 2 entries per input, got {ranks[:2]}")
    return Labels(("ik", "kj"), "ij")


def _linear_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    lead = _UPPER[:ranks[0] - 1]
    return Labels((lead + "k", "jk", "j"), lead + "j")


def _transposed_linear_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    lead = _UPPER[:ranks[0] - 1]
    return Labels((lead + "k", "kj", "j"), lead + "j")


_TWO = ((0, "input"), (1, "other"))
MATMUL = OpRule("matmul", ("input", "other"), (2,), _TWO, _matmul_labels)
BMM = OpRule("bmm", ("input", "mat2"), (2,), ((0, "input"), (1, "mat2")), _bmm_labels)
MM = OpRule("mm", ("input", "mat2"), (2,), ((0, "input"), (1, "mat2")), _mm_labels)
LINEAR = OpRule("linear", ("input", "weight", "bias"), (2, 3),
                ((0, "input"), (1, "weight"), (2, "bias")), _linear_labels)
#: ``x @ weight + bias`` with the weight stored ``[in, out]`` (HuggingFace GPT-2's ``Conv1D``)
TRANSPOSED_LINEAR = OpRule("transposed_linear", ("input", "weight", "bias"), (2, 3),
                           ((0, "input"), (1, "weight"), (2, "bias")),
                           _transposed_linear_labels)

# ----------------------------------------------------------------------------- elementwise


def _elementwise_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    n = max(ranks)
    letters = _UPPER[:n]
    return Labels(tuple(letters[n - r:] for r in ranks), letters, broadcast=frozenset(letters))


UNARY = OpRule("elementwise", ("input",), (1,), ((0, "input"),), _elementwise_labels)
BINARY = OpRule("elementwise", ("input", "other"), None, _TWO, _elementwise_labels)

# ----------------------------------------------------------------------------- normalisation


def _softmax_info(args: tuple, kwargs: dict) -> dict:
    dim = _get(args, kwargs, 1, "dim")
    _need(isinstance(dim, int), "softmax needs its dim given as an int to be sharded")
    return {"dim": dim}


def _softmax_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    letters = _UPPER[:ranks[0]]
    unsplit = {}
    if "dim" in info:
        dim = info["dim"] % ranks[0]
        unsplit[letters[dim]] = f"softmax cannot split the dimension it normalises (dim {dim})"
    return Labels((letters,), letters, unsplit=unsplit)


def _layer_norm_info(args: tuple, kwargs: dict) -> dict:
    shape = _get(args, kwargs, 1, "normalized_shape")
    return {"normalized_ndim": len(shape)} if isinstance(shape, (tuple, list)) else {}


def _norm_labels(name: str, params: int) -> Callable[[tuple[int, ...], dict], Labels]:
    """A norm's labels: the input's letters, ``params`` affine tensors (weight, bias) over the
    normalised trailing dimensions, which may not be split."""
    def labels(ranks: tuple[int, ...], info: dict) -> Labels:
        m = info.get("normalized_ndim", ranks[1] if len(ranks) > 1 else 1)
        letters = _UPPER[:ranks[0]]
        norm = letters[len(letters) - m:]
        why = f"{name} cannot split the dimensions it normalises (the last {m})"
        return Labels((letters, *[norm] * params), letters, unsplit=dict.fromkeys(norm, why))
    return labels


SOFTMAX = OpRule("softmax", ("input",), (1,), ((0, "input"),), _softmax_labels, _softmax_info)
LAYER_NORM = OpRule("layer_norm", ("input", "weight", "bias"), (1, 3),
                    ((0, "input"), (2, "weight"), (3, "bias")), _norm_labels("layer_norm", 2),
                    _layer_norm_info)
#: RMSNorm (``F.rms_norm``, ``nn.RMSNorm``, the HuggingFace decoders' own ``*RMSNorm``): a
#: weight and no bias, rows normalised on their own, so batch and sequence splits run locally
RMS_NORM = OpRule("rms_norm", ("input", "weight"), (1, 2), ((0, "input"), (2, "weight")),
                  _norm_labels("rms_norm", 1), _layer_norm_info)

# ----------------------------------------------------------------------------- lookups, attention


def _embedding_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    lead = _UPPER[:ranks[0]]
    return Labels((lead, "vd"), lead + "d")


def _sdpa_info(args: tuple, kwargs: dict) -> dict:
    _need(_get(args, kwargs, 3, "attn_mask") is None,
          "the sharded scaled_dot_product_attention takes no attn_mask (use is_causal=True, or "
          "leave attention untagged so DTensor handles it)")
    _need(not _get(args, kwargs, 4, "dropout_p", 0.0),
          "the sharded scaled_dot_product_attention takes no dropout_p: ranks computing the "
          "same slice would draw different masks")
    return {}


def _sdpa_labels(ranks: tuple[int, ...], info: dict) -> Labels:
    _need(len(set(ranks)) == 1 and ranks[0] >= 3,
          f"scaled_dot_product_attention strategies need the same number (>= 3) of entries for "
          f"query, key and value, got {ranks}")
    lead = _UPPER[:ranks[0] - 2]
    why = ("scaled_dot_product_attention can split only batch and head dimensions, not "
           "sequence or embedding")
    return Labels((lead + "td", lead + "sd", lead + "se"), lead + "te",
                  unsplit=dict.fromkeys("tsde", why))


EMBEDDING = OpRule("embedding", ("input", "weight"), (2,), ((0, "input"), (1, "weight")),
                   _embedding_labels, local=lambda slices: slices.get("v", 1) == 1)
SDPA = OpRule("scaled_dot_product_attention", ("query", "key", "value"), (3,),
              ((0, "query"), (1, "key"), (2, "value")), _sdpa_labels, _sdpa_info)
