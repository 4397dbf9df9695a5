"""Tests of the GPT training recipe (recipes/train.py and its helper modules).

Unit tests import the helpers in-process; the end-to-end tests launch the recipe the way a user
does (``torchrun --nproc-per-node 2 recipes/train.py`` on CPU/gloo, and ``python
recipes/train.py``) with a tiny model, and check metrics, Hydra outputs, checkpoints and that a
resumed run reproduces an uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException

from recipe_helpers import RECIPES, ROOT, compose_train, losses_of, recipe_env, run_recipe
from recipes import checkpoint, config_schema, corpus, metrics, optim, parallel_mode
from recipes.gpt import GPT
from recipes.metrics import read_metrics

# sha256 of generate_corpus(1234, 20_000): the corpus must be the same bytes on every machine.
CORPUS_20K_SHA256 = "f1bc8cb8ad2152b7c99342bd266b8469d1be00dcc08d42bd93b3f2549184bc25"


# ----------------------------------------------------------------------------- unit tests


def test_default_gpt_shape_and_size():
    cfg = compose_train()
    m = cfg.model
    model = GPT(40, m.d_model, m.n_layer, m.n_head, m.block_size, m.dropout)
    assert 1_000_000 <= model.num_params() <= 5_000_000
    idx = torch.randint(0, 40, (3, m.block_size))
    logits, loss = model(idx, idx.roll(1, dims=1))
    assert logits.shape == (3, m.block_size, 40)
    assert abs(loss.item() - math.log(40)) < 0.5  # untrained: close to uniform


def test_corpus_is_deterministic_and_cached(tmp_path):
    text = corpus.generate_corpus(1234, 20_000)
    assert text == corpus.generate_corpus(1234, 20_000)
    assert corpus.sha256(text) == CORPUS_20K_SHA256
    assert corpus.generate_corpus(1235, 20_000) != text
    assert corpus.load_corpus(tmp_path, 1234, 20_000) == text  # generated and written
    assert corpus.load_corpus(tmp_path, 1234, 20_000) == text  # read back
    assert [p.name for p in tmp_path.iterdir()] == ["grammar_v1_seed1234_20000.txt"]


def test_tokenizer_round_trips():
    text = corpus.generate_corpus(7, 5_000)
    tok = corpus.CharTokenizer(text)
    ids = tok.encode(text)
    assert ids.dtype == torch.uint8 and int(ids.max()) < tok.vocab_size
    assert tok.decode(ids) == text
    assert 30 <= tok.vocab_size <= 60


def test_rank_batches_concatenate_to_the_global_batch():
    tokens = torch.randint(0, 40, (10_000,), dtype=torch.uint8)
    kw = dict(seed=3, step=5, global_batch_size=8, seq_len=16)
    x, y = corpus.get_batch(tokens, **kw)
    parts = [corpus.get_batch(tokens, **kw, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(corpus.get_batch(tokens, **{**kw, "step": 6})[0], x)
    with pytest.raises(ValueError, match="divisible"):
        corpus.get_batch(tokens, **kw, rank=0, world_size=3)


def test_config_composes_and_typos_fail():
    cfg = compose_train()
    assert cfg.parallel.name == "data" and cfg.optim.name == "adamw"
    assert compose_train(["optim=sgd", "parallel=none"]).optim.momentum == 0.9
    for bad, key in [("optim.lrr=1", "optim.lrr"), ("trainer.max_stepz=3", "trainer.max_stepz"),
                     ("lr=1", "lr")]:
        with pytest.raises(ConfigCompositionException, match=f"Could not override '{key}'"):
            compose_train([bad])
    with pytest.raises(ConfigCompositionException):
        compose_train(["trainer.max_steps=abc"])  # wrong type
    with pytest.raises(ConfigCompositionException):
        compose_train(["parallel.mode=DATA_PARALEL"])  # not a ParallelMode
    config_schema.check_known_keys(cfg)
    added = compose_train(["+optim.lrr=1", "+trainer.extra=2"])  # "+" skips Hydra's check ...
    with pytest.raises(ValueError, match="optim.lrr, trainer.extra"):
        config_schema.check_known_keys(added)  # ... so the recipe makes its own


def test_lr_schedule_warms_up_then_decays():
    f = optim.warmup_cosine(warmup_steps=10, total_steps=110, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_stand_alone_refuses_several_ranks(monkeypatch):
    monkeypatch.setattr(parallel_mode.parallel, "get_world_size", lambda: 2)
    cfg = compose_train(["parallel=none"])
    with pytest.raises(ValueError, match="parallel=data"):
        parallel_mode.apply_parallel_mode(torch.nn.Linear(2, 2), cfg.parallel)


def test_latest_checkpoint_and_metrics_truncation(tmp_path):
    for name in ["step_000003", "step_000010", "step_000012.tmp", "other"]:
        (tmp_path / name).mkdir()
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    assert checkpoint.latest_checkpoint(tmp_path / "missing") is None
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    logger = metrics.MetricsLogger(path, enabled=True, resume_step=5)
    logger.log(step=6, loss=0.5)
    logger.close()
    assert [r["step"] for r in metrics.read_metrics(path)] == [1, 2, 3, 4, 5, 6]


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, cache) -> Path:
    """Two ranks straight to step 12, checkpointing every 6 steps. Dropout is on so that resuming
    must restore each rank's RNG state to reproduce this run."""
    run = tmp_path_factory.mktemp("runs") / "a"
    run_recipe(["trainer.max_steps=12", "trainer.checkpoint_every=6", "model.dropout=0.1"], 2,
               run, cache, torchrun=True)  # the command users type
    return run


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_two_ranks_trains_and_writes_outputs_once(run_a):
    losses = losses_of(run_a)
    assert sorted(losses) == list(range(1, 13))
    assert losses[12] < losses[1]
    record = metrics.read_metrics(run_a / "metrics.jsonl")[0]
    # (mfu where this host's FLOP/s were measured before: recipes/mfu.py, tests/test_mfu.py)
    assert set(record) - {"mfu"} == {"step", "loss", "lr", "tokens_per_s", "grad_norm",
                                     "peak_host_gib", "elapsed_s"}
    assert [p.relative_to(run_a) for p in run_a.rglob(".hydra")] == [Path(".hydra")]
    assert (run_a / ".hydra" / "config.yaml").is_file()
    assert (run_a / "train.log").is_file() and (run_a / "train_rank1.log").is_file()
    ckpts = sorted(p.name for p in (run_a / "checkpoints").iterdir())
    assert ckpts == ["step_000006", "step_000012"]  # no step_*.tmp left behind
    assert {"rank_00000.pt", "rank_00001.pt", ".metadata"} <= {
        p.name for p in (run_a / "checkpoints" / "step_000012").iterdir()}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_reproduces_the_uninterrupted_run_exactly(run_a, tmp_path, cache):
    b, c = tmp_path / "b", tmp_path / "c"
    same = ["trainer.checkpoint_every=6", "model.dropout=0.1"]
    # B stops at 6 but keeps A's 12-step LR schedule, as an interrupted A would have.
    run_recipe(["trainer.max_steps=6", "optim.total_steps=12", *same], 2, b, cache)
    run_recipe(["trainer.max_steps=12", f"trainer.resume_from={b / 'checkpoints' / 'step_000006'}",
          *same], 2, c, cache)
    a_losses, b_losses, c_losses = losses_of(run_a), losses_of(b), losses_of(c)
    assert sorted(c_losses) == list(range(7, 13))
    assert [b_losses[s] for s in range(1, 7)] == [a_losses[s] for s in range(1, 7)]
    assert [c_losses[s] for s in range(7, 13)] == [a_losses[s] for s in range(7, 13)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_single_process_matches_two_ranks(tmp_path, default_recipe_single):
    single, cache, printed = default_recipe_single
    two = tmp_path / "two"
    assert "Training summary" in printed
    assert (single / "checkpoints" / "step_000004" / ".metadata").is_file()
    proc = run_recipe(["trainer.max_steps=4", "trainer.progress_bar=true"], 2, two, cache,
                      output=True)
    # stderr is a pipe here, as in a cluster job's log: no carriage-return redraws in it
    log = (two / "train.log").read_text()
    assert "\r" not in proc.stderr and "progress bar off: stderr is not a terminal" in log
    config = json.loads(next(line for line in log.splitlines() if "- config: " in line)
                        .split("- config: ", 1)[1])  # the run's whole config, in its log
    assert config["trainer"]["max_steps"] == 4 and config["parallel"]["name"] == "data"
    # the process group is torn down quietly (torch warned "No backend of type 0" on each rank)
    assert "No backend of type" not in proc.stderr
    one_losses, two_losses = losses_of(single), losses_of(two)
    assert sorted(one_losses) == sorted(two_losses) == [1, 2, 3, 4]
    # Same global batches and averaged gradients: the same losses up to float summation order.
    assert [one_losses[s] for s in range(1, 5)] == pytest.approx(
        [two_losses[s] for s in range(1, 5)], rel=1e-4)
    # every step's gradient norm (before clipping) and peak memory are in the metrics: the two
    # ranks' norm is the one process's, on the same global batch
    norms = [[r["grad_norm"] for r in read_metrics(run / "metrics.jsonl")] for run in (single, two)]
    assert len(norms[0]) == 4 and all(n > 0 for n in norms[0])
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    assert all(r["peak_host_gib"] > 0 for r in read_metrics(two / "metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_cli_typo_fails_fast_with_hydras_message(tmp_path):
    env = recipe_env()
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "train.py"), "optim.lrr=1", f"hydra.run.dir={tmp_path}/x"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "Could not override 'optim.lrr'" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_the_progress_bar_is_drawn_only_on_a_terminal():
    import io

    from recipes.base import show_progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert show_progress_bar(True, Terminal())
    assert not show_progress_bar(True, io.StringIO())  # a file or a pipe
    assert not show_progress_bar(False, Terminal())  # trainer.progress_bar=false, or rank > 0
