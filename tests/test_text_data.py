"""``data=text``: your own .txt/.jsonl files with a trained byte-level BPE (or your tokenizer),
a held-out split and ``trainer.eval_every``; the generated corpus's held-out text is a second
corpus of the same grammar."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recipe_helpers import RECIPES, ROOT, losses_of, recipe_env
from recipes.metrics import read_metrics
from recipes.text_data import load_text, read_documents, text_files


def _write_texts(root):
    words = "the cat dog sat on mat and ran to a big red house with green door".split()
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text(
        "\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) + "."
                  for i in range(300)))
    (root / "docs" / "b.jsonl").write_text("\n".join(
        json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(9))})
        for i in range(200)))
    (root / "docs" / "skip.csv").write_text("not,text\n")
    return root / "docs"


def test_files_tokenizer_and_split(tmp_path):
    docs = _write_texts(tmp_path)
    assert [p.name for p in text_files(str(docs))] == ["a.txt", "b.jsonl"]
    assert [p.name for p in text_files(str(docs / "*.jsonl"))] == ["b.jsonl"]
    tok, train, held = load_text(str(docs), "text", None, 300, str(tmp_path / "cache"), 0.1)
    assert 257 <= tok.vocab_size <= 300
    assert abs(len(held) - 0.1 * (len(train) + len(held))) <= 1
    text = "the big red house"
    assert tok.decode(tok.tokenizer.encode(text).ids) == text  # byte-level: lossless
    again, *_ = load_text(str(docs), "text", None, 300, str(tmp_path / "cache"), 0.1)
    assert again.tokenizer.to_str() == tok.tokenizer.to_str()  # the cached BPE
    saved = tmp_path / "tok.json"
    tok.tokenizer.save(str(saved))
    mine, same, _ = load_text(str(docs), "text", str(saved), 9999, str(tmp_path / "x"), 0.1)
    assert mine.vocab_size == tok.vocab_size and same.tolist() == train.tolist()


@pytest.mark.parametrize("write, message", [
    (lambda p: None, "names no .txt or .jsonl file"),
    (lambda p: p.write_text('{"body": "x"}\n'), "must be an object with a string 'text'"),
    (lambda p: p.write_text('{"text": "ok"}\n{"text": "cut\n'),
     r"d.jsonl:2: not a JSON line \(Unterminated string .* at column 10\)"),
    (lambda p: p.write_bytes(b'{"text": "ok"}\n\x89PNG\r\n'),
     r"d.jsonl: not UTF-8 text \(byte 15 is 0x89\)"),
])
def test_bad_data_is_named(tmp_path, write, message):
    """Each on one line, naming the file (and the line)."""
    path = tmp_path / "d.jsonl"
    write(path)
    with pytest.raises(ValueError, match=message) as caught:
        read_documents(text_files(str(path)), "text")
    assert "\n" not in str(caught.value)


def test_a_garbage_tokenizer_file_is_named(tmp_path):
    (tmp_path / "d.txt").write_text("some text")
    garbage = tmp_path / "tokenizer.json"
    garbage.write_bytes(b"\x00\x01 not json")
    with pytest.raises(ValueError, match=r"data.tokenizer=.*tokenizer.json is not a tokenizers "
                                         r"JSON file \("):
        load_text(str(tmp_path / "d.txt"), "text", str(tmp_path), 300, str(tmp_path / "c"), 0.1)


@pytest.mark.slow
def test_the_recipe_trains_on_your_text_and_reports_eval_loss(tmp_path):
    docs = _write_texts(tmp_path)
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(RECIPES / "train.py"), "data=text", f"data.path={docs}",
         "data.vocab_size=300", f"data.cache_dir={tmp_path / 'cache'}", "data.global_batch_size=8",
         "model.d_model=32", "model.n_layer=1", "model.n_head=2", "model.block_size=16",
         "optim.lr=1e-2", "trainer.max_steps=20", "trainer.eval_every=10",
         "trainer.progress_bar=false", f"hydra.run.dir={run}"],
        cwd=ROOT, env=recipe_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = losses_of(run)
    assert losses[20] < losses[1]
    evals = [r["eval_loss"] for r in read_metrics(run / "metrics.jsonl") if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert "eval loss" in (run / "train.log").read_text()
