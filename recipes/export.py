"""Export a recipe checkpoint as one file of the whole model, or as a HuggingFace directory.

    python -m recipes.export outputs/runs/NAME/checkpoints/step_000300 --to safetensors
    python -m recipes.export CKPT_DIR --to torch --out model.pt
    python -m recipes.export CKPT_DIR --to hf --out my-gpt2/      # from_pretrained("my-gpt2")

Any layout a recipe writes works (one process, data parallel, semi-auto and optimizer-parallel
shards, pipeline stages, expert-parallel experts, parameter-server tables): the checkpoint is
verified against its checksums and read whole in this one process, without a process group
(``recipes/export_state.py``). ``--to safetensors`` writes ``model.safetensors`` with the
safetensors library, ``--to torch`` a ``torch.save`` of the state dict — both under the plain
model's parameter names, so ``model.load_state_dict(...)`` of the model the run built takes them
as they are. ``--to hf`` is ``recipes/export_hf.py``: a transformers model's own layout, or the
recipe's GPT as GPT-2. ``--weights`` picks the FP32 masters of an ``offload=optimizer`` run (the
default when present) or the 16-bit weights it trained with; ``--dtype`` casts floating tensors.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

from recipes.checkpoint_integrity import CheckpointError
from recipes.export_gpt2 import NotGPT2Error
from recipes.export_state import CheckpointModel, read_model_state

log = logging.getLogger("export")

FORMATS = ("safetensors", "hf", "torch")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SUFFIX = {"safetensors": ".safetensors", "torch": ".pt", "hf": "-hf"}


def default_out(ckpt_dir: Path, to: str) -> Path:
    """Beside the checkpoint: ``step_000300.safetensors``, ``.pt`` or ``step_000300-hf/``."""
    ckpt_dir = ckpt_dir.resolve()
    return ckpt_dir.with_name(ckpt_dir.name + _SUFFIX[to])


def export(ckpt_dir: str | Path, to: str, out: str | Path | None = None, *,
           weights: str = "auto", dtype: str | None = None, digest: str | None = None,
           force: bool = False) -> Path:
    """Write the model of the checkpoint at ``ckpt_dir`` in format ``to``; returns the path.
    Every argument is checked before anything is read or written. The output is written beside
    ``out`` and renamed into place, so a failed export leaves nothing half-written; an existing
    ``out`` is replaced only with ``force`` (a symlink is replaced, never written through)."""
    if to not in FORMATS:
        raise ValueError(f"--to {to!r} must be one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} must be one of {', '.join(DTYPES)}")
    ckpt_dir = Path(ckpt_dir)
    out = Path(out) if out is not None else default_out(ckpt_dir, to)
    if out.resolve() == ckpt_dir.resolve() or ckpt_dir.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} is inside the checkpoint {ckpt_dir}; write it elsewhere")
    _check_out(out, to, force)
    with warnings.catch_warnings():  # dcp.load(no_dist=True) says it loads in one process: yes
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        ckpt = read_model_state(ckpt_dir, weights, digest)
    if dtype is not None:
        ckpt.state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v
                      for k, v in ckpt.state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if to == "hf":
            from recipes.export_hf import export_hf

            export_hf(ckpt, tmp)
        elif to == "safetensors":
            _save_safetensors(ckpt, tmp)
        else:
            torch.save(ckpt.state, tmp)
        _replace(tmp, out)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp)
        elif tmp.exists():
            tmp.unlink()
    return out


def _check_out(out: Path, to: str, force: bool) -> None:
    """Refuse an ``--out`` the export would clobber or could not write, before any reading."""
    kind = "a directory" if to == "hf" else "a file"
    if out.is_symlink() or out.exists():
        if not force:
            raise ValueError(f"--out {out} exists; give --force to replace it (a symlink is "
                             f"replaced by the export, not written through)")
        if not out.is_symlink() and out.is_dir() != (to == "hf"):
            raise ValueError(f"--out {out} is {'a directory' if out.is_dir() else 'a file'}; "
                             f"--to {to} writes {kind}")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK)):
        raise ValueError(f"--out {out}: {parent} is not a writable directory")


def _replace(tmp: Path, out: Path) -> None:
    """Put the finished ``tmp`` at ``out``: a symlink or a file there is replaced by the rename
    itself, a directory (``--force`` with ``--to hf``) is removed first."""
    if out.is_dir() and not out.is_symlink():
        shutil.rmtree(out)
    elif out.is_symlink() and tmp.is_dir():
        out.unlink()  # os.replace will not put a directory over a link
    os.replace(tmp, out)


def _save_safetensors(ckpt: CheckpointModel, out: Path) -> None:
    """One ``.safetensors`` file; tied weights (stored under both names) become two tensors,
    since safetensors refuses tensors that share memory."""
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in ckpt.state.items()}
    seen: dict[int, str] = {}
    for k, v in state.items():
        if v.untyped_storage().data_ptr() in seen:
            state[k] = v.clone()
        seen[state[k].untyped_storage().data_ptr()] = k
    save_file(state, out, metadata={"format": "pt", "source": ckpt.path.name,
                                    "weights": "fp32_master" if ckpt.from_master else "model"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.export", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_N directory")
    parser.add_argument("--to", required=True, choices=FORMATS)
    parser.add_argument("--out", type=Path, default=None,
                        help="file (directory for --to hf); default: beside the checkpoint")
    parser.add_argument("--weights", choices=("auto", "model", "master"), default="auto",
                        help="auto: FP32 masters of an offload run when present (default)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="cast floating-point tensors (default: as stored)")
    parser.add_argument("--digest", default=None,
                        help="refuse the checkpoint unless its digest (printed when it was saved, "
                             "sha256:...) is this one")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --out (a symlink is replaced, not written "
                             "through)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = export(args.checkpoint, args.to, args.out, weights=args.weights, dtype=args.dtype,
                      digest=args.digest, force=args.force)
    except (ValueError, FileNotFoundError, CheckpointError, NotGPT2Error) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
