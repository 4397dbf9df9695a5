"""recipes/process_exit.py: a recipe process leaves with its own exit status, after its exit
handlers and with its output flushed, without the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _leave(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "entry.py"
    script.write_text(textwrap.dedent(f"""
        import atexit, sys
        from recipes.process_exit import run_then_exit
        atexit.register(lambda: open({str(tmp_path / "handler_ran")!r}, "w").close())
        def main():
            sys.stdout.write("unflushed line")  # no newline: still in the buffer at exit
            {body}
        run_then_exit(main)
        print("not reached")
    """))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT)}, timeout=60)


@pytest.mark.parametrize("body, status, stderr", [
    ("pass", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit(None)", 0, ""),
    ("sys.exit('config error: trainer.max_steps must be >= 1')", 1,
     "config error: trainer.max_steps must be >= 1"),
])
def test_exit_status_handlers_and_output_are_kept(tmp_path, body, status, stderr):
    proc = _leave(body, tmp_path)
    assert proc.returncode == status
    assert proc.stdout == "unflushed line"
    assert proc.stderr.strip() == stderr
    assert (tmp_path / "handler_ran").exists()


def test_an_exception_propagates_with_its_traceback(tmp_path):
    proc = _leave("raise RuntimeError('the model diverged')", tmp_path)
    assert proc.returncode == 1
    assert "RuntimeError: the model diverged" in proc.stderr
    assert "not reached" not in proc.stdout
