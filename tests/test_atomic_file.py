"""A file every rank saves to one path is never read half-written (``write_text_atomic``; a
saved plan read by one rank while another rewrote it was once an empty YAML)."""

from __future__ import annotations

import threading

import pytest

from foundation.atomic_file import write_text_atomic


def test_readers_see_one_whole_version_while_two_writers_rewrite_the_file(tmp_path):
    path = tmp_path / "plan.yaml"
    versions = {"a" * 200_000, "b" * 300_000}
    write_text_atomic(path, "a" * 200_000)
    stop = threading.Event()

    def write(text: str) -> None:
        while not stop.is_set():
            write_text_atomic(path, text)
    writers = [threading.Thread(target=write, args=(v,)) for v in sorted(versions)]
    for writer in writers:
        writer.start()
    try:
        seen = {path.read_text() for _ in range(300)}
    finally:
        stop.set()
        for writer in writers:
            writer.join()
    assert seen <= versions
    assert [p.name for p in tmp_path.iterdir()] == ["plan.yaml"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "profile.yaml"
    write_text_atomic(path, "old")
    with pytest.raises(TypeError):  # the write fails half-way: nothing of it stays
        write_text_atomic(path, 3)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.yaml"]
