"""The recipe's GPT (``recipes/gpt.py``) as HuggingFace GPT-2: config and weights.

The two are the same network, checked part by part: learned token and position embeddings summed,
then pre-LayerNorm blocks (``ln_1`` → attention with one fused q|k|v projection split in thirds,
heads of ``d / n_head``, scaled by ``1/sqrt(head_dim)``, causal → ``c_proj``; ``ln_2`` → MLP
``d → 4d → d``), residual adds, a final LayerNorm and a head tied to the token embedding, biases
on every linear layer but the head, LayerNorm eps 1e-5, dropout in the same three places. Two
settings differ from GPT-2's defaults and are written into the config: the MLP's activation is
the exact (erf) GELU of ``nn.GELU()`` (``activation_function="gelu"``, not GPT-2's tanh
``gelu_new``), and there are no BOS/EOS ids (the recipe's tokenizer has none). GPT-2 keeps its
linear weights as ``Conv1D`` (``[in, out]``), so those are transposed.

A GPT with mixture-of-experts MLPs (``model=gpt_moe``) has no GPT-2 equivalent and is refused by
name (:class:`NotGPT2Error`) rather than written as something else.
"""

from __future__ import annotations

from typing import Any

import torch

from recipes.checkpoint_integrity import CheckpointError


class NotGPT2Error(ValueError):
    """The checkpoint's model is not a network GPT-2 can express."""


#: recipe GPT name (inside block i) -> (GPT-2 name, transposed): Conv1D weights are [in, out]
_BLOCK = {
    "ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
    "mlp.0.weight": ("mlp.c_fc.weight", True), "mlp.0.bias": ("mlp.c_fc.bias", False),
    "mlp.2.weight": ("mlp.c_proj.weight", True), "mlp.2.bias": ("mlp.c_proj.bias", False),
}
_TOP = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
        "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}


def gpt2_config_kwargs(model_cfg: Any, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``GPT2Config`` keyword arguments for a recipe GPT of config ``model_cfg`` (the run's
    ``model`` group); NotGPT2Error naming the setting when GPT-2 cannot express it."""
    if model_cfg.get("num_experts", 0):
        raise NotGPT2Error(
            f"--to hf: model={model_cfg.name} has mixture-of-experts MLPs (model.num_experts="
            f"{model_cfg.num_experts}), which GPT-2 has no equivalent of; export it with --to "
            f"safetensors or --to torch")
    vocab, d_model = state["tok_emb.weight"].shape
    if d_model != model_cfg.d_model:
        raise CheckpointError(f"the checkpoint's token embedding is {d_model} wide but its "
                              f"config says model.d_model={model_cfg.d_model}")
    return dict(vocab_size=vocab, n_positions=model_cfg.block_size, n_embd=d_model,
                n_layer=model_cfg.n_layer, n_head=model_cfg.n_head, n_inner=4 * d_model,
                activation_function="gelu", resid_pdrop=model_cfg.dropout,
                embd_pdrop=model_cfg.dropout, attn_pdrop=model_cfg.dropout,
                layer_norm_epsilon=1e-5, scale_attn_weights=True, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)


def gpt2_state_dict(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """The recipe GPT's ``state`` under GPT-2's names and layouts (``lm_head`` tied: not kept);
    CheckpointError naming any parameter that has no place in GPT-2 or is missing."""
    out: dict[str, torch.Tensor] = {}
    unused = set(state) - {"lm_head.weight"}
    for ours, theirs in _TOP.items():
        out[theirs] = state[ours]
        unused.discard(ours)
    for i in range(n_layer):
        for ours, (theirs, transposed) in _BLOCK.items():
            key = f"blocks.{i}.{ours}"
            if key not in state:
                raise CheckpointError(f"--to hf: the checkpoint lacks {key}")
            out[f"transformer.h.{i}.{theirs}"] = state[key].t().contiguous() if transposed \
                else state[key]
            unused.discard(key)
    if unused:
        raise NotGPT2Error(f"--to hf: parameters with no GPT-2 equivalent: {sorted(unused)}")
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"],
                                                     state["tok_emb.weight"]):
        raise NotGPT2Error("--to hf: lm_head.weight differs from tok_emb.weight (GPT-2's head "
                           "is tied to its embedding)")
    return out
