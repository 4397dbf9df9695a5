"""``data=stream``: local files through HuggingFace ``datasets`` in streaming mode, packed into
windows, with epochs and a data position that resumes the same batches."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from recipe_helpers import TINY, losses_of, run_recipe
from recipes.metrics import read_metrics
from recipes.streamed_data import (
    Position,
    TokenStream,
    batch_rows,
    stream_files,
    stream_tokenizer,
)

WORDS = "the cat sat on a mat while dogs ran in parks and birds sang songs".split()


def _records(path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(count):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
            f.write(json.dumps({"text": f"{i} {words}", "id": i}) + "\n")


def _stream(tmp_path, count: int = 25, **kwargs) -> TokenStream:
    _records(tmp_path / "train" / "a.jsonl", count)
    files, builder = stream_files(str(tmp_path / "train"))
    tokenizer = stream_tokenizer(files, builder, "text", None, 300, str(tmp_path / "cache"))
    return TokenStream(files, builder, "text", tokenizer, seq_len=16, seed=7, **kwargs)


def test_windows_follow_each_other_and_epochs_reshuffle(tmp_path):
    stream = _stream(tmp_path, shuffle_buffer=50)
    batches = [stream.next_batch(4) for _ in range(30)]  # a few epochs of 25 short records
    assert all(b.shape == (4, 17) for b in batches)
    for batch in batches[:3]:  # each window starts where the last one's inputs ended
        assert all(batch[i, -1] == batch[i + 1, 0] for i in range(3))
    assert stream.position.epoch >= 2
    first = _stream(tmp_path, shuffle_buffer=50)
    assert all(torch.equal(first.next_batch(4), b) for b in batches[:5])  # seeded: the same
    in_order = _stream(tmp_path, shuffle_buffer=0)
    assert not torch.equal(in_order.next_batch(4), batches[0])  # the shuffle buffer reorders


@pytest.mark.parametrize("shuffle_buffer", [0, 50])
def test_a_stream_resumed_at_a_position_gives_the_same_batches(tmp_path, shuffle_buffer):
    stream = _stream(tmp_path, shuffle_buffer=shuffle_buffer)
    seen, positions = [], []
    for _ in range(40):  # across epoch boundaries and mid-record positions
        positions.append(stream.position)
        seen.append(stream.next_batch(3))
    assert {p.epoch for p in positions} >= {0, 1, 2}
    assert any(p.offset > 0 for p in positions)  # some batches start inside a record
    for at in (5, 17, 33):
        again = _stream(tmp_path, shuffle_buffer=shuffle_buffer)
        again.seek(positions[at])
        assert all(torch.equal(again.next_batch(3), want) for want in seen[at:at + 5]), at
    peek = stream.copy()
    assert torch.equal(peek.next_batch(3), stream.next_batch(3))  # a look leaves it in place


def test_each_rank_keeps_its_slice_of_the_global_batch():
    batch = torch.arange(4 * 5).reshape(4, 5)
    x, y = batch_rows(batch, 1, 2)
    assert torch.equal(x, batch[2:4, :-1]) and torch.equal(y, batch[2:4, 1:])


def test_parquet_records_stream_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _records(tmp_path / "j" / "a.jsonl", 20)
    rows = [json.loads(line) for line in (tmp_path / "j" / "a.jsonl").read_text().splitlines()]
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"body": [r["text"] for r in rows]}), tmp_path / "p" / "a.parquet")
    jfiles, jbuilder = stream_files(str(tmp_path / "j"))
    pfiles, pbuilder = stream_files(str(tmp_path / "p" / "*.parquet"))
    assert (jbuilder, pbuilder) == ("json", "parquet")
    tokenizer = stream_tokenizer(jfiles, jbuilder, "text", None, 300, str(tmp_path / "cache"))
    a = TokenStream(jfiles, jbuilder, "text", tokenizer, seq_len=8)
    b = TokenStream(pfiles, pbuilder, "body", tokenizer, seq_len=8)
    assert all(torch.equal(a.next_batch(2), b.next_batch(2)) for _ in range(5))


def test_bad_sources_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="names no .txt/.jsonl/.json/.parquet file"):
        stream_files(str(tmp_path / "nothing"))
    _records(tmp_path / "mixed" / "a.jsonl", 3)
    (tmp_path / "mixed" / "b.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"mixes formats \['json', 'text'\]"):
        stream_files(str(tmp_path / "mixed"))
    _records(tmp_path / "train" / "a.jsonl", 30)
    files, builder = stream_files(str(tmp_path / "train"))
    tokenizer = stream_tokenizer(files, builder, "text", None, 300, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="has no string 'body' \\(data.field\\)"):
        TokenStream(files, builder, "body", tokenizer, seq_len=8).next_batch(1)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "a.txt").write_text("hi")
    tiny, text = stream_files(str(tmp_path / "tiny"))
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1 = 65 tokens"):
        TokenStream(tiny, text, "text", tokenizer, seq_len=64).next_batch(1)
    assert Position() == Position(0, 0, 0)


@pytest.mark.slow
def test_the_recipe_resumes_a_stream_mid_epoch_with_the_same_batches(tmp_path):
    _records(tmp_path / "corpus" / "train.jsonl", 15)
    _records(tmp_path / "held" / "eval.jsonl", 20, seed=1)
    args = ["data=stream", f"data.path={tmp_path / 'corpus'}", "data.seq_len=16",
            f"data.eval_path={tmp_path / 'held'}", "trainer.eval_every=3",
            "data.shuffle_buffer=30", "trainer.max_steps=8", "trainer.checkpoint_every=4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    tiny = [a for a in TINY if not a.startswith("data.num_chars")]  # the generated corpus's
    run_recipe(args, 2, straight, tmp_path / "data", tiny=tiny)
    run_recipe([*args, f"trainer.resume_from={straight / 'checkpoints' / 'step_000004'}"], 2,
               resumed, tmp_path / "data", tiny=tiny)
    want, got = losses_of(straight), losses_of(resumed)
    assert sorted(got) == [5, 6, 7, 8] and all(got[s] == want[s] for s in got)
    evals = [r for r in read_metrics(resumed / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 8]  # every 3 steps and at the end
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in evals)
    log = (resumed / "train.log").read_text()
    assert "data position: epoch" in log
    position = log.split("data position: epoch ")[1].split()[0]
    assert int(position.rstrip(",")) >= 1  # 15 short records: an epoch ended before step 4
