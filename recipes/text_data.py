"""Your own text for the GPT recipe (``data=text data.path=...``): files, a real tokenizer, a
held-out split.

* ``data.path``: a file, a directory (every ``.txt``/``.jsonl`` under it) or a glob; ``.jsonl``
  lines give their ``data.jsonl_field`` (default ``"text"``). Files are read in sorted order and
  documents joined with the end-of-text token, so every rank reads the same token stream.
* The tokenizer is the ``tokenizers`` library's (what HuggingFace's fast tokenizers run on):
  ``data.tokenizer`` names a ``tokenizer.json`` or a HuggingFace tokenizer directory; without
  one a byte-level BPE of ``data.vocab_size`` tokens is trained on the files and cached in
  ``data.cache_dir`` under a hash of their bytes (the same file on every rank and launch).
* The last ``data.eval_fraction`` of the token stream is held out for ``trainer.eval_every``.

Batches are cut as from the generated corpus (``corpus.get_batch``): seeded random windows,
each data-parallel rank taking its slice of the step's global batch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

import torch

EOT = "<|endoftext|>"
SUFFIXES = (".txt", ".jsonl")


def text_files(path: str, suffixes: tuple[str, ...] = SUFFIXES, what: str = "data.path",
               kinds: str = ".txt or .jsonl") -> list[Path]:
    """The files with ``suffixes`` that ``path`` (a file, a directory or a glob) names, sorted;
    ValueError naming the setting ``what`` when there are none (``kinds``: the suffixes as the
    message says them)."""
    found = Path(path)
    if found.is_file():
        files = [found]
    elif found.is_dir():
        files = [p for p in found.rglob("*") if p.suffix in suffixes and p.is_file()]
    else:
        files = [Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file()]
    files = sorted(f for f in files if f.suffix in suffixes)
    if not files:
        raise ValueError(f"{what}={path!r} names no {kinds} file (a file, a directory or a "
                         f"glob)")
    return files


def read_documents(files: list[Path], field: str) -> list[str]:
    """Each ``.txt`` file is one document; each ``.jsonl`` line's ``field`` is one."""
    docs = []
    for path in files:
        text = _utf8(path)
        if path.suffix == ".txt":
            docs.append(text)
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg} at column "
                                 f"{err.colno}); each .jsonl line is one JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{number}: a .jsonl line must be an object with a "
                                 f"string {field!r} (data.jsonl_field)")
            docs.append(record[field])
    return docs


def _utf8(path: Path) -> str:
    """The text of ``path``; ValueError naming the file and the first bad byte when it is not
    UTF-8 (a binary file given as data)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        bad = err.object[err.start]
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start} is {bad:#04x}); data.path "
                         f"takes .txt and .jsonl text files") from None


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the recipe's interface (``vocab_size``, ``encode``,
    ``decode``)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()

    def encode(self, docs: list[str]) -> torch.Tensor:
        eot = self.tokenizer.token_to_id(EOT)
        ids: list[int] = []
        for doc in docs:
            ids += self.tokenizer.encode(doc).ids
            if eot is not None:
                ids.append(eot)
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (what ``recipes.export --to hf`` ships)."""
        return self.tokenizer.to_str()


def _digest(files: list[Path], vocab_size: int) -> str:
    h = hashlib.sha256(str(vocab_size).encode())
    for path in files:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def load_tokenizer(files: list[Path], docs: list[str], tokenizer: str | None,
                   vocab_size: int, cache_dir: str) -> TextTokenizer:
    """``tokenizer`` (a tokenizer.json or a directory holding one), or a byte-level BPE trained
    on ``docs`` and cached (atomically: ranks may race, the content is equal)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if tokenizer is not None:
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"data.tokenizer={tokenizer!r}: no tokenizer.json there")
        try:
            return TextTokenizer(Tokenizer.from_file(str(path)))
        except Exception as err:  # the Rust library raises a bare Exception
            raise ValueError(f"data.tokenizer={tokenizer!r}: {path} is not a tokenizers JSON "
                             f"file ({str(err).splitlines()[0] if str(err) else err!r})") from None
    cached = Path(cache_dir) / f"bpe_{_digest(files, vocab_size)}.json"
    if cached.exists():
        return TextTokenizer(Tokenizer.from_file(str(cached)))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    bpe.save(str(tmp))
    os.replace(tmp, cached)
    return TextTokenizer(bpe)


def load_text(path: str, field: str, tokenizer: str | None, vocab_size: int, cache_dir: str,
              eval_fraction: float) -> tuple[TextTokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, training tokens, held-out tokens) of the files ``path`` names."""
    files = text_files(path)
    docs = read_documents(files, field)
    tok = load_tokenizer(files, docs, tokenizer, vocab_size, cache_dir)
    tokens = tok.encode(docs)
    held = int(len(tokens) * eval_fraction)
    return tok, tokens[:len(tokens) - held], tokens[len(tokens) - held:]
