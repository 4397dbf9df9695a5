"""``make device-check`` (benchmarks/device_check.py) on a machine without an accelerator: the
rows a host can run run, the device rows are reported as skipped with the reason, the budget
stops rows that no longer fit, and the table is one markdown table (the whole command is run
by ``make device-check``; here its parts)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import foundation.device as hd

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    return importlib.import_module("device_check")  # benchmarks/ is on the path (conftest)


def test_the_environment_row_names_the_build_device_and_backend(check):
    row = check.environment()
    assert row.result == "PASS"
    assert hd.build_facts() in row.detail and f"device {hd.resolve('device')}" in row.detail
    assert f"backend {hd.default_backend_string()}" in row.detail


@pytest.mark.skipif(hd.has_accelerator(), reason="checks the host-only report")
def test_device_rows_are_skipped_by_name_without_an_accelerator(check, tmp_path):
    from device_check_multi import multi_device_rows

    for row in (check.marked_tests(False, 10), check.copy_bandwidth(False),
                check.offloaded_step(False, 10)):
        assert row.result == "SKIP" and "no accelerator" in row.detail
    (row,) = multi_device_rows(4, tmp_path, 10)
    assert row.result == "SKIP" and "need 2 or more" in row.detail


def test_only_files_with_a_test_for_the_accelerator_are_collected(check):
    files = check.marked_test_files("cuda")
    assert "tests/test_attention_block_kernels.py" in files
    assert all("@pytest.mark.cuda" in (ROOT / f).read_text() for f in files)
    assert "tests/test_device_check.py" not in files


def test_a_step_that_no_longer_fits_the_budget_is_reported_not_run(check, monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(check, "plan", lambda *a: [
        ("first", 20, lambda t: ran.append(("first", t)) or [check.Row("first", "PASS", "")]),
        ("second", 600, lambda t: ran.append(("second", t)) or [])])
    budget = check.Budget(40)
    rows = check.run_all(budget, False, 4, tmp_path)
    assert [r.step for r in rows] == ["environment", "first"]
    assert ran[0][0] == "first" and ran[0][1] <= 20
    assert len(ran) == 2 and ran[1][1] <= 40  # what is left, not the 600 it asked for
    budget.end = 0  # spent
    rows = check.run_all(budget, False, 4, tmp_path)
    assert rows[-1].result == "SKIP" and "not run: 0 s of the budget left" in rows[-1].detail


def test_the_table_is_one_markdown_table(check):
    rows = [check.Row("a", "PASS", "x | y", 1.4), check.Row("b", "SKIP", "why")]
    text = check.table(rows)
    lines = text.splitlines()
    assert lines[0] == "| step | result | figures | s |" and len(lines) == 4
    assert all(line.count("|") == 5 for line in lines)


def test_a_figure_line_is_taken_not_a_table_header(check):
    out = ("configuration   step ms  vs GPU  peak GiB  B/param  idle\n"
           "OffloadAdamW step vs DeepSpeed ZeRO-Offload 0.91x, FSDP2 CPUOffloadPolicy 0.62x; "
           "idle 12%, peak 3.10 GiB\n")
    assert check.last_line(out, "OffloadAdamW step vs").startswith("OffloadAdamW step vs")
    header_only = "configuration   step ms  vs GPU  peak GiB  B/param\n"
    assert check.last_line(header_only, "step ms") == header_only.strip()  # nothing else


@pytest.mark.slow
def test_a_host_resume_with_deterministic_kernels_is_bitwise(check, tmp_path):
    row = check.deterministic_resume(False, 4, tmp_path, 300)
    assert row.result == "PASS" and "identical" in row.detail and "on the host" in row.detail
