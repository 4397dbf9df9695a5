"""The GPT recipe's tokens: where a step's batch and the held-out batches come from.

Three sources (``conf/data/``): the generated corpus (its held-out text a second corpus of a
tenth of its size from the next seed: the same grammar, other sentences), your text files
(``data=text``, a fraction held out) and a stream of record files (``data=stream``, held-out
files in ``data.eval_path``), whose position a checkpoint keeps so a resumed run reads the
batches the first would have read.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from recipes.checkpoint import data_position
from recipes.corpus import CharTokenizer, get_batch, load_corpus
from recipes.streamed_data import Position, TokenStream, batch_rows, stream_files, stream_tokenizer
from recipes.text_data import load_text

log = logging.getLogger("train")

#: held-out batches are cut from their own seed, the same windows at every evaluation
EVAL_SEED_OFFSET = 1_000_003


class TrainData:
    """Tokenizer, training tokens and held-out tokens of ``data`` (``conf/data/``); held-out
    text is loaded only when ``evaluate``."""

    def __init__(self, d: DictConfig, seed: int, evaluate: bool) -> None:
        self.d, self.seed = d, seed
        self.stream: TokenStream | None = None
        self.eval_files: Any = None
        if d.name == "stream":
            files, builder = stream_files(d.path)
            self.tokenizer: Any = stream_tokenizer(files, builder, d.field, d.tokenizer,
                                                   d.vocab_size, d.cache_dir)
            self.stream = TokenStream(files, builder, d.field, self.tokenizer, d.seq_len,
                                      seed=seed, shuffle_buffer=d.shuffle_buffer)
            if evaluate and d.eval_path is None:
                raise ValueError("trainer.eval_every with data=stream reads held-out files: "
                                 "give data.eval_path")
            self.eval_files = stream_files(d.eval_path, "data.eval_path") if evaluate else None
            self.tokens = self.eval_tokens = torch.zeros(0, dtype=torch.int32)
            return
        if d.name == "text":
            self.tokenizer, self.tokens, self.eval_tokens = load_text(
                d.path, d.jsonl_field, d.tokenizer, d.vocab_size, d.cache_dir, d.eval_fraction)
        else:
            text = load_corpus(d.cache_dir, d.corpus_seed, d.num_chars)
            self.tokenizer = CharTokenizer(text)
            self.tokens = self.tokenizer.encode(text)
            self.eval_tokens = self.tokenizer.encode(load_corpus(
                d.cache_dir, d.corpus_seed + 1, max(d.num_chars // 10, 4 * d.seq_len))
                if evaluate else "")
        if evaluate and len(self.eval_tokens) <= d.seq_len + 1:
            raise ValueError(f"trainer.eval_every needs held-out text longer than data.seq_len="
                             f"{d.seq_len}: it has {len(self.eval_tokens)} tokens (raise "
                             f"data.eval_fraction)")

    def batch(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank`` of ``world_size``'s slice of step ``step``'s global batch, on the host:
        a streamed source's next one (step 0: a look at it, for planning, that leaves the
        stream where it is)."""
        d = self.d
        if self.stream is not None:
            source = self.stream.copy() if step == 0 else self.stream
            return batch_rows(source.next_batch(d.global_batch_size), rank, world_size)
        return get_batch(self.tokens, seed=self.seed, step=step,
                         global_batch_size=d.global_batch_size, seq_len=d.seq_len, rank=rank,
                         world_size=world_size)

    def held_out(self, batches: int, rank: int, world_size: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``batches`` held-out global batches, this rank's slice of each, on the
        host: the same ones at every evaluation (held-out files read from their start, in
        order)."""
        d = self.d
        held = None if self.eval_files is None else TokenStream(
            *self.eval_files, d.field, self.tokenizer, d.seq_len)
        for i in range(batches):
            if held is not None:
                yield batch_rows(held.next_batch(d.global_batch_size), rank, world_size)
            else:
                yield get_batch(self.eval_tokens, seed=self.seed + EVAL_SEED_OFFSET, step=i,
                                global_batch_size=d.global_batch_size, seq_len=d.seq_len,
                                rank=rank, world_size=world_size)

    def position(self) -> dict[str, int] | None:
        """Where a streamed source is (kept in a checkpoint), or None for the others."""
        return None if self.stream is None else dataclasses.asdict(self.stream.position)

    def resume(self, checkpoint: Path) -> None:
        """A streamed source where the checkpoint's run had it: the same batches from here on
        (the other sources cut each step's batch from its number)."""
        if self.stream is None:
            return
        saved = data_position(checkpoint)
        if saved is None:
            raise ValueError(f"{checkpoint} keeps no data position (written with another "
                             f"data source than data=stream): resuming would not continue "
                             f"its batches")
        self.stream.seek(Position(**saved))
        log.info("data position: epoch %d, record %d, token %d", saved["epoch"],
                 saved["record"], saved["offset"])

    def describe(self) -> str:
        """The training data in a few words, for the set-up log."""
        return ("streamed training data" if self.stream is not None
                else f"{len(self.tokens)} training tokens")
