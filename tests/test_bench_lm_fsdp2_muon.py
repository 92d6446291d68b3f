"""benchmarks/lm_fsdp2_muon.py: FSDP2 + distributed fo.muon + fo.adamw trains the byte-level LM
as one process of torch Muon + AdamW does, on the same global batches.

One tiny comparison (2 gloo ranks, 12 steps, every method in lock step) feeds every test: (a)
FSDP2 + ``fo.muon`` (matrices) + ``fo.adamw`` (the rest), (b) the one-process reference, and
two wrong methods the same bounds must reject, so the (a)-(b) check can fail: (c) Newton-Schulz
on each rank's local shard only, (d) AdamW in place of Muon.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from copy import deepcopy
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
STEPS = 12


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    # Imported by its own name: the spawned ranks unpickle ``lm_fsdp2_muon._train`` by that
    # name, from the parent's sys.path (which holds benchmarks/ while the module's tests run).
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("lm_fsdp2_muon")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def result(bench: ModuleType) -> dict[str, Any]:
    config = replace(bench.QUICK, steps=STEPS, every=4)
    names = (*bench.METHODS, *bench.CONTROLS)
    return bench.compare(config, names, timeout_s=240)  # type: ignore[no-any-return]


def test_the_bounds_are_rounding_level(bench: ModuleType) -> None:
    # The stated tolerance of (a) vs (b); loosening it is a visible change of this test.
    assert bench.FIRST_RELATIVE <= 1e-6
    assert bench.EARLY_STEPS >= 10
    assert bench.EARLY_RELATIVE <= 3e-5
    assert bench.RUN_RELATIVE <= 1e-2
    assert bench.HELD_OUT_RELATIVE <= 1e-3


def test_matrices_are_the_blocks_2d_weights(bench: ModuleType) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        charlm = importlib.import_module("_charlm")
    finally:
        sys.path.remove(str(BENCHMARKS))
    model = charlm.CharTransformer(context=8, width=8, layers=2, heads=2)
    chosen = [name for name, p in model.named_parameters() if bench.is_matrix(name, p)]
    per_block = ["qkv.weight", "proj.weight", "mlp.0.weight", "mlp.2.weight"]
    assert chosen == [f"blocks.{i}.{w}" for i in range(2) for w in per_block]
    # the embedding (the tied output head too) and the position table are 2-D but not Muon's
    assert not bench.is_matrix("embed.weight", model.embed.weight)
    assert not bench.is_matrix("position", model.position)


def test_fsdp2_muon_matches_one_process_torch_muon(
    bench: ModuleType, result: dict[str, Any]
) -> None:
    assert result["fused"]  # torch 2.13 runs fused AdamW on CPU: both sides use it
    gaps = bench.gaps(result, bench.FSDP2_MUON)
    assert bench.within_tolerance(gaps), gaps
    a, b = result["methods"][bench.FSDP2_MUON], result["methods"][bench.REFERENCE]
    assert len(a["curve"]) == len(b["curve"]) == STEPS
    assert b["curve"][-1] < b["curve"][0] - 0.5  # it learns: the comparison is not of noise
    assert a["curve"] != b["curve"]  # two real runs (sums in another order), not one twice
    assert len(result["matrices"]) == 2 * 4
    assert a["step_ms"] > 0
    assert b["step_ms"] > 0


@pytest.mark.parametrize("letter", ["c", "d"])
def test_the_bounds_reject_a_wrong_method(
    bench: ModuleType, result: dict[str, Any], letter: str
) -> None:
    name = {v: k for k, v in bench.LETTERS.items()}[letter]
    gaps = bench.gaps(result, name)
    assert gaps["first"] <= bench.FIRST_RELATIVE  # step 1's forward precedes any step
    assert not bench.within_tolerance(gaps)
    assert gaps["early"] > 10 * bench.EARLY_RELATIVE, gaps


def test_report_and_verdicts(bench: ModuleType, result: dict[str, Any]) -> None:
    text = "\n".join(bench.report(result))
    assert "| (a) FSDP2 + fo.muon + fo.adamw |" in text
    assert "| (b) 1 process: torch Muon + AdamW |" in text
    assert text.count("\n| 1 |") == 1  # the curve table starts at step 1
    checks = bench.verdicts(result)
    assert len(checks) == 3
    assert all(line.startswith("PASS") for line in checks), checks
    # A gap of 1e-4 relative at step 5 (3x the early bound) must fail the (a)-(b) verdict.
    broken = deepcopy(result)
    broken["methods"][bench.FSDP2_MUON]["curve"][4] *= 1 + 1e-4
    assert bench.verdicts(broken)[0].startswith("FAIL")
    # and a control that met the bounds would fail its verdict
    broken = deepcopy(result)
    broken["methods"][bench.PER_SHARD] = broken["methods"][bench.FSDP2_MUON]
    assert bench.verdicts(broken)[1].startswith("FAIL")


def test_unknown_methods_are_rejected_before_spawning(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="distinct names"):
        bench.compare(bench.QUICK, ("Muon",))
    with pytest.raises(ValueError, match="distinct names"):
        bench.compare(bench.QUICK, (bench.FSDP2_MUON, bench.FSDP2_MUON))
