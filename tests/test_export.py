"""``python -m recipes.export``: a checkpoint of any layout as one file, or as a HF directory.

Round trips: a two-rank semi-auto checkpoint (DTensor shards) and a two-rank pipeline checkpoint
(two stages) export to safetensors and torch files whose tensors equal the checkpoint's bit for
bit under the plain model's names (``GPT.load_state_dict`` takes them strictly), and to a GPT-2
directory whose ``from_pretrained`` logits equal the trained GPT's. In one process: an offload
run exports its FP32 masters, a MoE GPT and Wide&Deep are refused for ``--to hf`` by name, a
changed byte fails the checksums, and a tiny transformers Llama saved the way the recipe saves
(wrapped, config inline) comes back through ``--to hf`` with equal logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch import nn

import parallel
from recipe_helpers import checkpoint_tensors, recipe_env, run_recipe, train_in_process
from recipes.checkpoint import HF_CONFIG, save_checkpoint
from recipes.checkpoint_integrity import CheckpointError
from recipes.export import export
from recipes.export_gpt2 import NotGPT2Error
from recipes.export_state import plain_names
from recipes.gpt import GPT

STEP = Path("checkpoints") / "step_000002"
TWO_LAYERS = ["model.n_layer=2", "trainer.max_steps=2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def _model_tensors(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors as DCP's own dcp_to_torch_save reads them."""
    return {k.removeprefix("model."): v for k, v in checkpoint_tensors(ckpt, tmp).items()
            if k.startswith("model.")}


def _gpt_from(state: dict[str, torch.Tensor], n_layer: int) -> GPT:
    vocab, d_model = state["tok_emb.weight"].shape
    model = GPT(vocab, d_model, n_layer, 2, 64)
    model.load_state_dict(state)  # strict: the plain model's names, nothing missing or extra
    return model.eval()


def _assert_round_trip(ckpt: Path, tmp: Path, n_layer: int) -> None:
    want = _model_tensors(ckpt, tmp)
    got = load_file(export(ckpt, "safetensors", tmp / f"{ckpt.parent.parent.name}.safetensors"))
    pt = torch.load(export(ckpt, "torch", tmp / f"{ckpt.parent.parent.name}.pt"))
    assert got.keys() == want.keys() == pt.keys()
    assert all(torch.equal(got[k], want[k]) and torch.equal(pt[k], want[k]) for k in want)
    gpt = _gpt_from(got, n_layer)
    from transformers import GPT2LMHeadModel

    out = export(ckpt, "hf", tmp / f"{ckpt.parent.parent.name}-hf")
    hf = GPT2LMHeadModel.from_pretrained(out)
    idx = torch.randint(0, gpt.tok_emb.num_embeddings, (2, 16), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(idx).logits, gpt(idx)[0], rtol=1e-5, atol=1e-5)
    # the run's tokenizer ships with it: AutoTokenizer encodes as the run's CharTokenizer did
    from transformers import AutoTokenizer

    chars = json.loads((ckpt / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(chars, key=chars.get) == sorted(chars)  # CharTokenizer: ids in sorted order
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "".join(sorted(chars))[:12]
    assert tokenizer(text)["input_ids"] == [chars[c] for c in text]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_and_pipeline_checkpoints_export_whole(tmp_path, cache):
    for layout in ("semi_auto", "pipeline"):
        run_recipe([*TWO_LAYERS, f"parallel={layout}"], 2, tmp_path / layout, cache)
        _assert_round_trip(tmp_path / layout / STEP, tmp_path, n_layer=2)
    cli = [sys.executable, "-m", "recipes.export", str(tmp_path / "pipeline" / STEP),
           "--to", "safetensors"]
    proc = subprocess.run(cli, env=recipe_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "pipeline" / "checkpoints" / "step_000002.safetensors").is_file()


def test_offload_run_exports_its_fp32_masters_and_refusals_name_the_reason(tmp_path, cache):
    off = tmp_path / "off"
    train_in_process(["parallel=none", "offload=optimizer", "hetero.offload_kernel=torch",
                      *TWO_LAYERS], off, cache)
    ckpt = off / STEP
    masters = load_file(export(ckpt, "safetensors", tmp_path / "m.safetensors"))
    trained = load_file(export(ckpt, "safetensors", tmp_path / "w.safetensors", weights="model"))
    assert masters["tok_emb.weight"].dtype == torch.float32
    assert trained["tok_emb.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(masters["tok_emb.weight"].bfloat16(), trained["tok_emb.weight"])
    half = load_file(export(ckpt, "safetensors", tmp_path / "h.safetensors", dtype="float16"))
    assert half["ln_f.weight"].dtype == torch.float16
    with pytest.raises(ValueError, match="--to 'onnx' must be one of"):
        export(ckpt, "onnx")
    with pytest.raises(ValueError, match="inside the checkpoint"):
        export(ckpt, "torch", ckpt / "model.pt")

    moe = tmp_path / "moe"
    train_in_process(["parallel=none", "model=gpt_moe", "model.d_model=32", "model.n_head=2",
                      "model.n_layer=2", "trainer.max_steps=2"], moe, cache)
    with pytest.raises(NotGPT2Error, match=r"model=gpt_moe has mixture-of-experts MLPs"):
        export(moe / STEP, "hf", tmp_path / "moe-hf")
    assert not (tmp_path / "moe-hf").exists()
    assert "blocks.1.mlp.experts.w1" in load_file(export(moe / STEP, "safetensors",
                                                         tmp_path / "moe.safetensors"))

    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        export(ckpt, "safetensors", tmp_path / "bad.safetensors")


def test_wrapper_prefixes_are_removed_only_when_a_wrapper_added_them():
    t = torch.zeros(1)
    assert list(plain_names({"module.a._orig_mod.b": t, "module.c": t})) == ["a.b", "c"]
    assert list(plain_names({"module.x": t, "head.y": t})) == ["module.x", "head.y"]
    assert list(plain_names({"stages.0.blocks.0.w": t})) == ["blocks.0.w"]


class _RecipeWrapper(nn.Module):
    """Stands for a recipe-side wrapper (``.module``, as the house convention has it)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_transformers_model_exports_to_its_own_layout(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    inline = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    fields = dict(inline)
    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in fields.items()
                                            if k != "model_type"}))
    parallel.init()
    try:
        opt = torch.optim.AdamW(llama.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        cfg = OmegaConf.create({"model": {"name": "hf", "config": inline}})
        ckpt = save_checkpoint(tmp_path / "ck", 1, _RecipeWrapper(llama), opt, sched,
                               torch.device("cpu"), config=cfg)
    finally:
        parallel.destroy()
    assert (ckpt / HF_CONFIG).is_file()
    out = export(ckpt, "hf", tmp_path / "llama-hf")
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, llama.eval()(idx).logits)
    (ckpt / HF_CONFIG).unlink()  # older checkpoint: the run config's model.config says it
    (ckpt / "checksums.json").unlink()
    loaded = AutoModelForCausalLM.from_pretrained(export(ckpt, "hf", tmp_path / "again")).eval()
    with torch.no_grad():
        assert torch.equal(loaded(idx).logits, llama(idx).logits)
