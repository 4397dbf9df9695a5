"""A checkpoint is data: loading one runs no code from it (foundation/trusted_checkpoint.py).

A planted ``.metadata`` (its checksums recomputed, or removed) and a planted byte item are refused
by name through resume, export and ``model.weights``; each payload would write a marker file,
and the tests check that it never appears. Genuine checkpoints keep loading: every resume,
export and sharded-load test in the suite goes through the same reader.
"""

from __future__ import annotations

import builtins
import operator
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foundation import trusted_checkpoint
from foundation.trusted_checkpoint import UntrustedCheckpointError
from parallel.weights.files import open_weights
from recipe_helpers import train_in_process
from recipes.checkpoint_integrity import (
    CHECKSUMS,
    CheckpointError,
    checkpoint_digest,
    write_checksums,
)
from recipes.export import export

STEP = Path("checkpoints") / "step_000002"
TINY_RUN = ["parallel=none", "model.n_layer=1", "trainer.max_steps=2",
            "trainer.checkpoint_every=2"]


class _Run:
    """``exec(code)`` when unpickled."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return builtins.exec, (self.code,)


class _ThenReturn:
    """Unpickles as ``value`` after running ``first``: a payload that leaves no trace in the
    loaded result (the genuine metadata comes back and training would carry on)."""

    def __init__(self, first: object, value: object) -> None:
        self.first, self.value = first, value

    def __reduce__(self):
        return operator.getitem, ((self.first, self.value), 1)


def _marker_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').close()"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("genuine")
    train_in_process(TINY_RUN, run, tmp_path_factory.mktemp("data"))
    return run / STEP


def _planted_copy(genuine: Path, tmp_path: Path, checksums: str) -> tuple[Path, Path]:
    """A copy of ``genuine`` whose ``.metadata`` runs a payload, then returns the real metadata;
    ``checksums``: "recomputed" (an attacker's) or "removed"."""
    ckpt = tmp_path / "step_000002"
    shutil.copytree(genuine, ckpt)
    marker = tmp_path / "payload_ran"
    with open(ckpt / ".metadata", "rb") as handle:
        real = pickle.load(handle)  # the genuine file this test wrote itself
    with open(ckpt / ".metadata", "wb") as handle:
        pickle.dump(_ThenReturn(_Run(_marker_code(marker)), real), handle)
    if checksums == "recomputed":
        write_checksums(ckpt)
    else:
        (ckpt / CHECKSUMS).unlink()
    return ckpt, marker


def test_the_planted_metadata_is_a_real_payload(genuine, tmp_path):
    """The attack works on an unguarded reader: torch's own unpickles it and runs the code."""
    ckpt, marker = _planted_copy(genuine, tmp_path, "recomputed")
    metadata = dcp.FileSystemReader(str(ckpt)).read_metadata()
    assert marker.exists() and "model.tok_emb.weight" in metadata.state_dict_metadata


@pytest.mark.parametrize("checksums", ["recomputed", "removed"])
def test_planted_metadata_is_refused_by_export_resume_and_weights(genuine, tmp_path, checksums):
    ckpt, marker = _planted_copy(genuine, tmp_path, checksums)
    refused = r"\.metadata: refused: it names the global _?operator\.getitem"
    with pytest.raises(UntrustedCheckpointError, match=refused):
        export(ckpt, "safetensors", tmp_path / "out.safetensors")
    with pytest.raises(UntrustedCheckpointError, match=refused):
        open_weights(ckpt)
    with pytest.raises(UntrustedCheckpointError, match=refused):
        train_in_process([*TINY_RUN, "trainer.max_steps=4", f"trainer.resume_from={ckpt}"],
                         tmp_path / "resumed", tmp_path / "data")
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_a_planted_byte_item_is_refused_before_it_is_unpickled(tmp_path):
    marker = tmp_path / "payload_ran"
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2), "lr": _Run(_marker_code(marker))}, checkpoint_id=ckpt,
             no_dist=True)
    state = {"w": torch.zeros(2), "lr": 0.0}
    with pytest.raises(UntrustedCheckpointError,
                       match=r"checkpoint item 'lr': refused: it is not plain data.*exec"):
        trusted_checkpoint.load(state, ckpt, no_dist=True)
    assert not marker.exists()


def test_genuine_byte_items_and_tensors_load(tmp_path):
    ckpt = tmp_path / "ckpt"
    saved = {"w": torch.arange(4.0), "group": {"lr": 0.1, "betas": (0.9, 0.95), "name": None}}
    dcp.save(saved, checkpoint_id=ckpt, no_dist=True)
    state = {"w": torch.zeros(4), "group": {"lr": 0.0, "betas": (0.0, 0.0), "name": "x"}}
    trusted_checkpoint.load(state, ckpt, no_dist=True)
    assert torch.equal(state["w"], saved["w"]) and state["group"] == saved["group"]
    assert set(trusted_checkpoint.read_metadata(ckpt).state_dict_metadata) >= {"w"}


@pytest.mark.parametrize("content, named", [
    (b"", "not a readable DCP metadata file"),
    (b"\x80\x04\x95", "not a readable DCP metadata file"),
    (pickle.dumps({"a": 1}), "holds a dict, not DCP's Metadata"),
])
def test_truncated_or_foreign_metadata_is_named(tmp_path, content, named):
    (tmp_path / ".metadata").write_bytes(content)
    with pytest.raises(UntrustedCheckpointError, match=rf"\.metadata: {named}"):
        trusted_checkpoint.read_metadata(tmp_path)


def test_a_pinned_digest_admits_only_that_checkpoint(tmp_path):
    """The digest printed at save pins the checkpoint: export and resume with it succeed; a
    planted copy whose checksums were recomputed, another digest, or no manifest are refused
    before anything else is read."""
    run = tmp_path / "run"
    summary = train_in_process(TINY_RUN, run, tmp_path / "data")
    ckpt = run / STEP
    digest = summary["digest"]
    assert digest == checkpoint_digest(ckpt) and digest.startswith("sha256:")
    assert export(ckpt, "safetensors", tmp_path / "ok.safetensors", digest=digest).exists()
    resumed = train_in_process([*TINY_RUN, "trainer.max_steps=3", f"trainer.resume_from={ckpt}",
                                f"trainer.resume_digest={digest}"], tmp_path / "resumed",
                               tmp_path / "data")
    assert resumed["steps"] == "3..3"

    planted, marker = _planted_copy(ckpt, tmp_path / "planted", "recomputed")
    with pytest.raises(CheckpointError, match=rf"has digest sha256:\w+, not the expected {digest}"):
        export(planted, "safetensors", tmp_path / "bad.safetensors", digest=digest)
    with pytest.raises(CheckpointError, match="not the checkpoint that was pinned"):
        train_in_process([*TINY_RUN, "trainer.max_steps=3", f"trainer.resume_from={planted}",
                          f"trainer.resume_digest={digest}"], tmp_path / "r2", tmp_path / "data")
    (planted / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match="has no checksums.json .* it has no digest"):
        export(planted, "safetensors", tmp_path / "bad.safetensors", digest=digest)
    assert not marker.exists() and not (tmp_path / "bad.safetensors").exists()


def test_export_never_destroys_a_users_file(genuine, tmp_path):
    """An existing --out needs --force; a symlink is replaced, its target untouched; a directory
    given to a file format (and a file to --to hf) is refused before the checkpoint is read;
    the file names the checkpoint, not its absolute path."""
    from safetensors import safe_open

    mine = tmp_path / "mine.safetensors"
    mine.write_text("a user's file")
    with pytest.raises(ValueError, match=r"--out .*mine.safetensors exists; give --force"):
        export(genuine, "safetensors", mine)
    assert mine.read_text() == "a user's file"
    assert export(genuine, "safetensors", mine, force=True) == mine
    with safe_open(str(mine), "pt") as f:
        assert f.metadata()["source"] == "step_000002"

    target = tmp_path / "elsewhere.pt"
    target.write_text("the link's target")
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="exists; give --force"):
        export(genuine, "torch", link)
    export(genuine, "torch", link, force=True)
    assert not link.is_symlink() and target.read_text() == "the link's target"

    unreadable = tmp_path / "not_a_checkpoint"  # the --out check comes first
    unreadable.mkdir()
    (tmp_path / "a_dir").mkdir()
    with pytest.raises(ValueError, match=r"a_dir is a directory; --to safetensors writes a file"):
        export(unreadable, "safetensors", tmp_path / "a_dir", force=True)
    with pytest.raises(ValueError, match=r"mine.safetensors is a file; --to hf writes a directory"):
        export(unreadable, "hf", mine, force=True)
    assert not list(tmp_path.glob(".*tmp*"))


def test_a_truncated_shard_without_checksums_is_one_named_line(genuine, tmp_path):
    """Without checksums.json (an older checkpoint) a cut .distcp reached torch's zip reader
    and escaped export's handler as a CheckpointException (a BaseException)."""
    ckpt = tmp_path / "step_000002"
    shutil.copytree(genuine, ckpt)
    (ckpt / CHECKSUMS).unlink()
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    with pytest.raises(UntrustedCheckpointError,
                       match=r"step_000002: not a readable checkpoint \(\w+: .*\); a file was "
                             r"truncated") as caught:
        export(ckpt, "safetensors", tmp_path / "out.safetensors")
    assert "\n" not in str(caught.value) and not (tmp_path / "out.safetensors").exists()


def test_a_planted_optimizer_byte_item_is_refused_by_resume(genuine, tmp_path):
    """The payload in an optimizer param group (a byte item DCP reads with
    ``weights_only=False``), the checksums recomputed: resume refuses it by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(genuine, whole)
    state = torch.load(whole, weights_only=True)  # written by this test from a genuine one
    key = next(k for k in state["optim"] if k.startswith("param_groups.") and k.endswith(".lr"))
    marker = tmp_path / "payload_ran"
    state["optim"][key] = _Run(_marker_code(marker))  # flat keys, as the recipe saves them
    ckpt = tmp_path / "step_000002"
    dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    for extra in genuine.iterdir():  # config, tokenizer, per-rank extras beside DCP's files
        if not (ckpt / extra.name).exists() and extra.name != CHECKSUMS:
            shutil.copy(extra, ckpt / extra.name)
    write_checksums(ckpt)
    with pytest.raises(UntrustedCheckpointError,
                       match=rf"checkpoint item 'optim.{key}': refused: it is not plain "
                             r"data .*exec"):
        train_in_process([*TINY_RUN, "trainer.max_steps=3", f"trainer.resume_from={ckpt}"],
                         tmp_path / "resumed", tmp_path / "data")
    assert not marker.exists()
