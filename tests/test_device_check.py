"""``make device-check`` (benchmarks/device_check.py) on a machine without an accelerator: the
CPU-possible steps run, the device steps are reported as skipped with the reason, and the table
is one markdown table (the full run is ``make device-check``; here the in-process parts)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import foundation.device as hd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("device_check",
                                                  ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_environment_row_names_the_build_device_and_backend(check):
    row = check.environment()
    assert row.result == "PASS"
    assert hd.build_facts() in row.detail and f"device {hd.resolve('device')}" in row.detail
    assert f"backend {hd.default_backend_string()}" in row.detail


@pytest.mark.skipif(hd.has_accelerator(), reason="checks the host-only report")
def test_device_steps_are_skipped_by_name_without_an_accelerator(check, tmp_path):
    assert check.marked_tests(False).result == "SKIP"
    assert all(r.result == "SKIP" and "no accelerator" in r.detail
               for r in check.benchmarks(False))
    (row,) = check.parallel_modes(4, tmp_path)
    assert row.result == "SKIP" and "needs 2 or more" in row.detail


def test_the_table_is_one_markdown_table(check):
    rows = [check.Row("a", "PASS", "x | y", 1.4), check.Row("b", "SKIP", "why")]
    text = check.table(rows)
    lines = text.splitlines()
    assert lines[0] == "| step | result | figures | s |" and len(lines) == 4
    assert all(line.count("|") == 5 for line in lines)


def test_a_benchmark_row_takes_its_figures_not_its_tables_header(check):
    out = ("model                                  partitions       ms  unplaced ms  ratio\n"
           "gpt2, embedding on cpu                          2     3.10         3.00  1.033\n"
           "no GPU available: the embedding-on-CPU vs all-on-GPU comparison needs one\n")
    keys = check.BENCHMARKS["benchmarks/placement_overhead.py"][1]
    assert check._last_line(out, *keys).startswith("gpt2, embedding on cpu")
    header_only = "configuration   step ms  vs GPU  peak GiB  B/param\n"
    assert check._last_line(header_only, "ratio", "peak") == header_only.strip()  # nothing else
