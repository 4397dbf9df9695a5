"""``python -m recipes.generate``: sampling from a recipe checkpoint and from its HuggingFace
export with the run's tokenizer; the same weights give the same tokens (greedy), a seed fixes a
sample, and impossible settings are refused by name."""

from __future__ import annotations

import pytest

from recipe_helpers import train_in_process
from recipes.export import export
from recipes.generate import load, main, sample


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    train_in_process(["trainer.max_steps=30", "parallel=none", "trainer.checkpoint_every=30"],
                     root / "run", root / "data")
    ckpt = root / "run" / "checkpoints" / "step_000030"
    return ckpt, export(ckpt, "hf", root / "hf")


def _ids(capsys, *args: str) -> list[int]:
    assert main([*args, "--ids"]) == 0
    return [int(x) for x in capsys.readouterr().out.split()]


def test_a_checkpoint_and_its_export_generate_the_same_tokens(trained, capsys):
    ckpt, hf = trained
    want = _ids(capsys, str(ckpt), "--prompt", "the ", "--greedy", "--max-new-tokens", "24")
    assert len(want) > 24  # the prompt's tokens, then 24 more
    assert _ids(capsys, str(hf), "--prompt", "the ", "--greedy", "--max-new-tokens", "24") == want
    assert _ids(capsys, str(ckpt), "--prompt", "the ", "--top-k", "1",
                "--max-new-tokens", "24") == want  # one candidate: the greedy choice
    assert main([str(ckpt), "--prompt", "the ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("the ")  # text, decoded by the run's tokenizer


def test_a_seed_fixes_a_sample(trained):
    logits_of, tokenizer, context = load(trained[0])
    prompt = tokenizer.encode("a").ids
    draw = lambda seed: sample(logits_of, prompt, 40, temperature=1.5, top_p=0.9,  # noqa: E731
                               context=context, seed=seed)
    assert draw(3) == draw(3) and draw(3) != draw(4)
    long = sample(logits_of, prompt, 80, temperature=0, context=context)  # past block_size
    assert len(long) == 81


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--top-k", "-2"], "--top-k must be an int >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1"),
])
def test_impossible_settings_are_refused_by_name(trained, capsys, args, message):
    import re

    assert main([str(trained[0]), *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_directory_that_is_no_model_is_refused(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
