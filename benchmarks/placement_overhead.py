"""What ``hetero.place`` costs: forward + backward of placed models vs the same models unplaced.

On a host-only machine nothing really crosses devices ("device" is the CPU), so the ratio is the
runtime's own overhead: partition dispatch, the boundary copies' no-op checks, the host worker
thread, the capture cache's key and guard. Three models — the recipe's 1.8 M-parameter GPT and
tiny HuggingFace GPT-2 and Llama (hidden 64) — each placed with no tags (one partition) and with
the token embedding on the CPU. With a GPU present the same rows measure the real host round trip
against everything on the GPU.

    python benchmarks/placement_overhead.py [--steps 30] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import foundation.device as hd
import hetero

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: recipes
from recipes.gpt import GPT  # noqa: E402


def _recipe_gpt() -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    model = GPT(vocab_size=64, d_model=192, n_layer=4, n_head=6, block_size=64, dropout=0.0)
    return model, lambda m: m.tok_emb


def _hf(kind: str) -> tuple[nn.Module, Callable[[nn.Module], nn.Module]]:
    import transformers as tf

    common = dict(vocab_size=64, use_cache=False, bos_token_id=0, eos_token_id=0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, **common)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, **common)
        model = tf.LlamaForCausalLM(cfg)
    return model, lambda m: m.get_input_embeddings()


def _loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx, idx) if isinstance(getattr(model, "model", model), GPT) \
        else model(input_ids=idx, labels=idx)
    return out[1] if isinstance(out, tuple) else out.loss


def _one_step_ms(model: nn.Module, idx: torch.Tensor) -> float:
    hd.synchronize()
    start = time.perf_counter()
    _loss(model, idx).backward()
    hd.synchronize()
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def _interleaved_ms(models: dict[str, nn.Module], idx: torch.Tensor, steps: int
                    ) -> dict[str, float]:
    """Median step time of each model, the models taking turns step by step so that drift in
    the machine's load hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(steps + 3):
        for name, model in models.items():
            ms = _one_step_ms(model, idx)
            if i >= 3:  # warm-up: capture, allocator, first kernels
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dev = hd.resolve("device")
    idx = torch.randint(0, 64, (args.batch, 64), device=dev)
    print(f"batch {args.batch}x64, device {dev}, torch threads {torch.get_num_threads()}; "
          f"median of {args.steps} fwd+bwd steps, the models taking turns")
    print(f"{'model':<38} {'partitions':>10} {'ms':>8} {'unplaced ms':>12} {'ratio':>6}")
    for name, build in (("GPT 1.8M (recipe)", _recipe_gpt),
                        ("HF GPT-2 (hidden 64)", lambda: _hf("gpt2")),
                        ("HF Llama (hidden 64)", lambda: _hf("llama"))):
        torch.manual_seed(0)
        base, embedding = build()
        base = base.to(dev)
        untagged = hetero.place(copy.deepcopy(base))
        tagged = copy.deepcopy(base)
        hetero.set_device(embedding(tagged), "cpu")
        tagged = hetero.place(tagged)
        models = {"unplaced": copy.deepcopy(base), "no tags": untagged,
                  "embedding on cpu": tagged}
        ms = _interleaved_ms(models, idx, args.steps)
        plain = ms.pop("unplaced")
        for row, t in ms.items():
            label = f"{name}, {row}"
            print(f"{label:<38} {len(models[row].plan):>10} {t:>8.2f} {plain:>12.2f} "
                  f"{t / plain:>6.3f}")
    if not hd.has_accelerator():
        print("no GPU available: the embedding-on-CPU vs all-on-GPU comparison needs one")


if __name__ == "__main__":
    main()
