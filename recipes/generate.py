"""Sample text from a recipe checkpoint or from its HuggingFace export.

    python -m recipes.generate outputs/runs/NAME/checkpoints/step_000300 --prompt "The "
    python -m recipes.generate outputs/runs/NAME/checkpoints/step_000300-hf --greedy
    python -m recipes.generate CKPT --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1

A checkpoint (``recipes/checkpoint.py``, any layout that wrote it) is read whole in this process
(:func:`recipes.export_state.read_model_state`, checksums verified) and its model rebuilt from the
run's config; an export (``python -m recipes.export --to hf``) is loaded by transformers. Both
use the tokenizer the run trained (``tokenizer.json``, which both carry). One sampling loop
serves both, so the same weights give the same tokens: ``--greedy`` (or ``--temperature 0``)
takes the most likely token; otherwise the logits are divided by the temperature, cut to the
``--top-k`` most likely and to the smallest set whose probability reaches ``--top-p``, and a
token is drawn with a generator seeded by ``--seed``. The context is the last ``block_size``
tokens for the recipe GPT (its learned positions end there).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer

from recipes.checkpoint import TOKENIZER_FILE

Logits = Callable[[torch.Tensor], torch.Tensor]  # ids [1, T] -> logits [1, T, vocab]


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ValueError naming the first setting that cannot sample."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be an int >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"--top-k must be an int >= 0 (0: no cut), got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (1: no cut), got {top_p!r}")


@torch.no_grad()
def sample(logits_of: Logits, prompt: list[int], max_new_tokens: int, *,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           context: int | None = None, seed: int = 0) -> list[int]:
    """``prompt`` followed by ``max_new_tokens`` tokens drawn from ``logits_of`` (module doc)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens: give at least one character the "
                         "run's tokenizer knows")
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        window = ids[-context:] if context else ids
        logits = logits_of(torch.tensor([window]))[0, -1].float().cpu()
        if temperature == 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k and top_k < logits.numel():
            logits[logits < torch.topk(logits, top_k).values[-1]] = float("-inf")
        if top_p < 1:
            ordered, order = torch.sort(logits, descending=True)
            before = torch.softmax(ordered, dim=0).cumsum(0) - torch.softmax(ordered, dim=0)
            logits[order[before >= top_p]] = float("-inf")  # the smallest set reaching top_p
        probs = torch.softmax(logits, dim=0)
        ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    return ids


def load(path: str | Path) -> tuple[Logits, Tokenizer, int | None]:
    """(logits function, tokenizer, context length) of a checkpoint or an HF export at
    ``path``."""
    path = Path(path)
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{path} has no {TOKENIZER_FILE}: give a recipe checkpoint "
                                f"(a step_N directory) or its --to hf export")
    tokenizer = Tokenizer.from_file(str(path / TOKENIZER_FILE))
    if (path / ".metadata").is_file():
        return _from_checkpoint(path, tokenizer)
    if (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path).eval()
        return (lambda ids: model(ids).logits), tokenizer, None
    raise FileNotFoundError(f"{path} is neither a recipe checkpoint (no .metadata) nor a "
                            f"transformers export (no config.json)")


def _from_checkpoint(path: Path, tokenizer: Tokenizer) -> tuple[Logits, Tokenizer, int | None]:
    """The recipe GPT of a checkpoint, rebuilt from its config and loaded whole."""
    from recipes.export_state import read_model_state
    from recipes.models import build_model

    with warnings.catch_warnings():  # dcp.load(no_dist=True) says it loads in one process: yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        ckpt = read_model_state(path)
    model_cfg = ckpt.config.get("model") if ckpt.config is not None else None
    if model_cfg is None or model_cfg.get("name") not in ("gpt", "gpt_moe"):
        raise ValueError(f"{path}: generating straight from a checkpoint takes the recipe GPT "
                         f"(model=gpt, gpt_moe); export another model first (python -m "
                         f"recipes.export {path} --to hf) and generate from the export")
    model = build_model(model_cfg, tokenizer.get_vocab_size()).model
    model.load_state_dict(ckpt.state)  # strict: the plain model's names
    model.eval()
    return (lambda ids: model(ids)[0]), tokenizer, int(model_cfg.block_size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m recipes.generate",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a recipe checkpoint (step_N) or its --to hf export")
    ap.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: all)")
    ap.add_argument("--greedy", action="store_true", help="the most likely token each time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ids", action="store_true", help="print the token ids, not the text")
    args = ap.parse_args(argv)
    temperature = 0.0 if args.greedy else args.temperature
    try:
        check_sampling(args.max_new_tokens, temperature, args.top_k, args.top_p)
        logits_of, tokenizer, context = load(args.path)
        ids = sample(logits_of, tokenizer.encode(args.prompt).ids, args.max_new_tokens,
                     temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                     context=context, seed=args.seed)
    except (ValueError, FileNotFoundError) as err:
        print(f"recipes.generate: {err}", file=sys.stderr)
        return 2
    print(" ".join(map(str, ids)) if args.ids else tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
