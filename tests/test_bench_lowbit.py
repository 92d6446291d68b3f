"""benchmarks/lowbit_states.py: the side-by-side low-bit optimizer benchmark (issue 24, item 4).

One ``--quick`` run feeds the smoke tests: both tables with every row and column, finite
numbers, torch's rows as the baseline, peers either measured or reported with their error (they
are optional: without torchao / bitsandbytes their rows say "not installed"); our rows must be
measured. The state byte counter and the row checks are tested directly.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import functional_optim as fo

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))  # it imports _harness and _charlm by name
    try:
        yield importlib.import_module("lowbit_states")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def run_all(bench: ModuleType) -> ModuleType:
    del bench  # benchmarks/ is on sys.path while it is alive
    return importlib.import_module("run_all")


@pytest.fixture(scope="module")
def quick(bench: ModuleType, run_all: ModuleType) -> dict[str, Any]:
    markdown = bench.main(["--quick"])
    lines = markdown.splitlines()
    not_run = {}
    for line in lines[lines.index("Not run:") + 1 :] if "Not run:" in lines else []:
        if not line.startswith("- "):
            break
        label, why = line[2:].split(": ", 1)
        not_run[label] = why
    return {"markdown": markdown, "tables": run_all.parse_tables(markdown), "not_run": not_run}


def _rows(quick: dict[str, Any], label: str) -> list[list[str]]:
    """The body rows of ``label`` in both tables."""
    return [row for t in quick["tables"] for row in t.rows if row[0] == label]


def _numbers(cells: list[str]) -> list[float]:
    """The figures of ``cells`` (``"1.5x"``, ``"+0.12% ± 0.01%"``), each one finite."""
    values = []
    for cell in cells:
        for part in cell.replace("±", " ").split():
            text = part.rstrip("x%")
            values.append(float(text))
            assert math.isfinite(values[-1]), cells
    return values


def test_quick_report_has_both_tables_with_every_row(
    bench: ModuleType, quick: dict[str, Any]
) -> None:
    steps, quality = quick["tables"]
    assert tuple(steps.headers) == bench.STEP_HEADERS
    assert tuple(quality.headers) == bench.QUALITY_HEADERS
    labels = [row.label for row in bench.ROWS]
    splits = [count for count, _ in bench.QUICK.splits]
    assert [(r[0], int(r[1])) for r in steps.rows] == [(x, c) for c in splits for x in labels]
    assert [r[0] for r in quality.rows] == labels
    for row in [*steps.rows, *quality.rows]:
        if row[0] not in quick["not_run"]:
            assert "n/a" not in row, row
    assert set(quick["not_run"]) <= set(labels)


def test_torch_rows_run_and_the_baseline_is_one(bench: ModuleType, quick: dict[str, Any]) -> None:
    for label in (bench.BASELINE.label, bench.FOREACH.label):
        assert label not in quick["not_run"]
        steps = [row for row in quick["tables"][0].rows if row[0] == label]
        for row in steps:
            ms, _, _, state = _numbers(row[2:])
            assert ms > 0
            assert 8.0 <= state < 8.01  # exp_avg + exp_avg_sq in fp32, plus a step counter
        quality = _numbers(_rows(quick, label)[-1][1:])
        assert quality[0] > 0  # the least-squares loss
        assert 8.0 <= quality[3] < 8.01
        assert 0 < quality[4] < math.log(256)  # held-out nats per byte: it learned something
    baseline = [row for row in quick["tables"][0].rows if row[0] == bench.BASELINE.label]
    assert all(row[3] == "1.00x" for row in baseline)
    assert _rows(quick, bench.BASELINE.label)[-1][2] == "+0.00% ± 0.00%"


@pytest.mark.parametrize("library", ["torchao", "bitsandbytes"])
def test_peer_rows_are_measured_or_report_their_error(
    bench: ModuleType, quick: dict[str, Any], library: str
) -> None:
    for row in (r for r in bench.ROWS if r.library == library):
        if importlib.util.find_spec(library) is None:
            assert quick["not_run"][row.label].startswith("not installed (pip install")
        if row.label in quick["not_run"]:
            assert quick["not_run"][row.label].strip()
            assert "\n" not in quick["not_run"][row.label]
            continue
        for cells in _rows(quick, row.label):
            _numbers(cells[1:])


def test_our_rows(bench: ModuleType, quick: dict[str, Any]) -> None:
    for row in (r for r in bench.ROWS if r.library == "ours"):
        assert row.label not in quick["not_run"], quick["not_run"][row.label]
        *steps, quality = _rows(quick, row.label)
        for cells in steps:
            ms, _, _, state = _numbers(cells[2:])
            assert ms > 0
            assert 0 < state < 4  # quantised moments: well under fp32's 8 bytes
        assert 0 < _numbers(quality[1:])[4] < math.log(256)


def test_state_bytes_count_each_storage_once(bench: ModuleType) -> None:
    param = torch.nn.Parameter(torch.ones(10))
    param.grad = torch.ones(10)
    adamw = torch.optim.AdamW([param], fused=True)
    adamw.step()
    assert bench.state_nbytes(adamw) == 2 * 10 * 4 + 4  # two fp32 moments and the step
    shared = torch.zeros(6, dtype=torch.float64)
    sgd = torch.optim.SGD([param])
    sgd.state[param] = {"a": shared, "b": shared, "view": shared[2:], "n": 3, "t": (shared,)}
    assert bench.state_nbytes(sgd) == 6 * 8


def test_rows_that_cannot_run_say_why(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in bench.PEERS else find_spec(name, *a),
    )
    torchao = next(row for row in bench.ROWS if row.library == "torchao")
    assert bench.row_error(torchao) == "not installed (pip install torchao==0.18.0)"
    assert bench.row_error(bench.BASELINE) is None
    ours = next(row for row in bench.ROWS if row.library == "ours")
    monkeypatch.delattr(fo, ours.name, raising=False)
    assert (
        bench.row_error(ours)
        == f"not available yet: functional_optim has no {ours.name} (issue 24)"
    )


def test_it_is_registered_with_run_all(run_all: ModuleType) -> None:
    assert "lowbit_states" in run_all.BENCHMARKS
    assert "lowbit_states" in run_all.discover(BENCHMARKS)
