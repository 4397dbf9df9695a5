"""Streamed data for the GPT recipe (``data=stream data.path=...``): local text, JSON-lines or
Parquet files read through HuggingFace ``datasets`` in streaming mode, with epochs and a data
position that a checkpoint keeps, so a resumed run continues with the same batches.

* ``data.path``: a file, a directory or a glob of ``.txt`` (one document per file), ``.jsonl``
  or ``.parquet`` files (one document per record, its ``data.field``), all of one format.
  ``datasets.load_dataset(..., streaming=True)`` reads them a record at a time: nothing is
  loaded whole, so the files may be larger than memory.
* Each epoch the records come in a seeded order (``ds.shuffle(seed + epoch, buffer_size=
  data.shuffle_buffer)``; 0: the files' order), are tokenized (the run's tokenizer, as for
  ``data=text``: given, or a byte-level BPE trained on one pass of the stream and cached) with
  the end-of-text token after each, and packed into windows of ``seq_len + 1`` tokens, each
  starting ``seq_len`` tokens after the last. A global batch is the next
  ``data.global_batch_size`` windows; every rank reads the stream and keeps its slice, so the
  batches are the same whatever the number of ranks. The tail of an epoch too short for a
  window is dropped.
* The position is where the next window starts: the epoch, the record's index in the epoch's
  order and the token in it. A resume reopens the epoch's order, skips that many records
  (``ds.skip``, the library's own) and drops that many tokens: the same windows as an
  uninterrupted run, bit for bit.
* ``data.eval_path``: held-out files for ``trainer.eval_every``, read in order from their start
  at each evaluation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from recipes.text_data import EOT, TextTokenizer, load_tokenizer, text_files

#: a file suffix -> the ``datasets`` builder that reads it
FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def stream_files(path: str, what: str = "data.path") -> tuple[list[Path], str]:
    """The files ``path`` names (sorted) and their ``datasets`` builder; ValueError naming the
    setting when there are none or they mix formats."""
    files = text_files(path, tuple(FORMATS), what, kinds="/".join(FORMATS))
    formats = {FORMATS[f.suffix] for f in files}
    if len(formats) > 1:
        raise ValueError(f"{what}={path!r} mixes formats {sorted(formats)}; give files of one "
                         f"(a directory or glob per format)")
    return files, formats.pop()


@dataclasses.dataclass(frozen=True)
class Position:
    """Where the next window starts: token ``offset`` of record ``record`` of epoch ``epoch``
    (records counted in the epoch's shuffled order)."""

    epoch: int = 0
    record: int = 0
    offset: int = 0


def documents(files: list[Path], builder: str, field: str, seed: int, epoch: int,
              shuffle_buffer: int, skip: int = 0) -> Iterator[str]:
    """The records' text in epoch ``epoch``'s order, from record ``skip`` on."""
    try:
        from datasets import load_dataset
    except ModuleNotFoundError:
        raise ModuleNotFoundError("data=stream reads its files through HuggingFace datasets, "
                                  "which is not installed: pip install -e '.[data]'") from None

    options: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    ds = load_dataset(builder, data_files=[str(f) for f in files], split="train",
                      streaming=True, **options)
    if shuffle_buffer:
        ds = ds.shuffle(seed=seed + epoch, buffer_size=shuffle_buffer)
    if skip:
        ds = ds.skip(skip)
    column = "text" if builder == "text" else field
    for number, record in enumerate(ds, skip):
        text = record.get(column)
        if not isinstance(text, str):
            raise ValueError(f"record {number} of {[f.name for f in files][:3]}... has no "
                             f"string {column!r} (data.field); its keys: {sorted(record)}")
        yield text


class TokenStream:
    """Global batches of windows packed from the records (module docstring)."""

    def __init__(self, files: list[Path], builder: str, field: str, tokenizer: TextTokenizer,
                 seq_len: int, seed: int = 0, shuffle_buffer: int = 0,
                 position: Position | None = None) -> None:
        self.files, self.builder, self.field = files, builder, field
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.seed, self.shuffle_buffer = seed, shuffle_buffer
        self.position = position or Position()
        self._open(self.position)

    def seek(self, position: Position) -> None:
        """Continue from ``position`` (a checkpoint's): the same windows as a run that got
        there."""
        self.position = position
        self._open(position)

    def copy(self) -> TokenStream:
        """A stream at this one's position that moves on its own (a look at the next batch)."""
        return TokenStream(self.files, self.builder, self.field, self.tokenizer, self.seq_len,
                           self.seed, self.shuffle_buffer, self.position)

    def _open(self, at: Position) -> None:
        self._docs = documents(self.files, self.builder, self.field, self.seed, at.epoch,
                               self.shuffle_buffer, skip=at.record)
        self._next_record = at.record
        self._epoch = at.epoch
        self._tokens: list[int] = []
        self._marks: list[tuple[int, int]] = []  # (record, offset) of each buffered token
        self._drop = at.offset  # tokens of the first record already consumed

    def _fill(self, need: int) -> bool:
        """Buffer at least ``need`` tokens of this epoch; False at its end."""
        eot = self.tokenizer.tokenizer.token_to_id(EOT)
        while len(self._tokens) < need:
            text = next(self._docs, None)
            if text is None:
                return False
            ids = self.tokenizer.tokenizer.encode(text).ids + ([eot] if eot is not None else [])
            record, self._next_record = self._next_record, self._next_record + 1
            start, self._drop = self._drop, 0
            self._tokens += ids[start:]
            self._marks += [(record, i) for i in range(start, len(ids))]
        return True

    def next_batch(self, rows: int) -> torch.Tensor:
        """The next ``rows`` windows, ``[rows, seq_len + 1]`` token ids; the position moves past
        them (into the next epoch when this one runs out)."""
        width, out = self.seq_len + 1, []
        empty_epochs = 0
        while len(out) < rows:
            if not self._fill(width):
                empty_epochs = empty_epochs + 1 if not out else 0
                if empty_epochs > 1:
                    raise ValueError(f"data.path: the records hold fewer than seq_len + 1 = "
                                     f"{width} tokens in all: no window to train on")
                self._open(Position(self._epoch + 1))
                continue
            out.append(self._tokens[:width])
            del self._tokens[:self.seq_len], self._marks[:self.seq_len]
        record, offset = self._marks[0] if self._marks else (self._next_record, 0)
        self.position = Position(self._epoch, record, offset)
        return torch.tensor(out, dtype=torch.long)


def batch_rows(batch: torch.Tensor, rank: int, world_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of this rank's slice of a global batch of windows."""
    per = batch.shape[0] // world_size
    mine = batch[rank * per:(rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def stream_tokenizer(files: list[Path], builder: str, field: str, tokenizer: str | None,
                     vocab_size: int, cache_dir: str) -> TextTokenizer:
    """The run's tokenizer: ``tokenizer``, or a byte-level BPE trained on one pass of the
    records in the files' order and cached under a hash of their bytes."""
    return load_tokenizer(files, documents(files, builder, field, seed=0, epoch=0,
                                           shuffle_buffer=0), tokenizer, vocab_size, cache_dir)
