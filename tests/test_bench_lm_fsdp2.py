"""benchmarks/lm_fsdp2.py: FSDP2 + fo.adamw trains the byte-level LM as DDP + torch AdamW does.

One ``--quick`` comparison (2 gloo ranks, 60 steps, every method in lock step on the same
batches) feeds every test: (a) DDP + torch AdamW, (b) FSDP2 + ``fo.Optimizer(fo.adamw)``,
(c) FSDP2 + torch AdamW, and (d) a wrong optimizer (Adam with L2 decay) that the bounds must
reject, so the (a)-(b) check can fail.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    # Imported by its own name: the spawned ranks unpickle ``lm_fsdp2._train`` by that name,
    # from the parent's sys.path (which holds benchmarks/ while the module's tests run).
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("lm_fsdp2")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def result(bench: ModuleType) -> dict[str, Any]:
    names = (*bench.METHODS, bench.WRONG)
    return bench.compare(bench.QUICK, names, timeout_s=240)  # type: ignore[no-any-return]


def test_the_bounds_are_float32_rounding(bench: ModuleType) -> None:
    # The stated tolerance of (a) vs (b); loosening it is a visible change of this test.
    assert bench.EARLY_STEPS >= 10
    assert bench.EARLY_RELATIVE <= 1e-6
    assert bench.RUN_RELATIVE <= 1e-5


def test_fsdp2_fo_adamw_matches_ddp_torch_adamw_within_rounding(
    bench: ModuleType, result: dict[str, Any]
) -> None:
    assert result["fused"]  # torch 2.13 runs fused AdamW on CPU: every method uses it
    gaps = bench.rounding_gaps(result, bench.FSDP2_FO)
    assert gaps["first"] == 0.0, gaps  # same weights, same batch: the same forward
    assert bench.within_rounding(gaps), gaps
    a, b = result["methods"][bench.DDP_TORCH], result["methods"][bench.FSDP2_FO]
    assert len(a["curve"]) == len(b["curve"]) == bench.QUICK.steps
    assert a["curve"][-1] < a["curve"][0] - 1.0  # it learns: the comparison is not of noise


def test_fsdp2_fo_adamw_equals_fsdp2_torch_adamw_bitwise(
    bench: ModuleType, result: dict[str, Any]
) -> None:
    b, c = result["methods"][bench.FSDP2_FO], result["methods"][bench.FSDP2_TORCH]
    assert b["curve"] == c["curve"]
    assert b["held_out"] == c["held_out"]
    difference, where, bitwise = result["weights"][(bench.FSDP2_FO, bench.FSDP2_TORCH)]
    assert bitwise, f"final weights differ by {difference} in {where}"


def test_the_bounds_reject_a_wrong_optimizer(bench: ModuleType, result: dict[str, Any]) -> None:
    gaps = bench.rounding_gaps(result, bench.WRONG)
    assert gaps["first"] == 0.0  # the forward of step 1 happens before any optimizer step
    assert not bench.within_rounding(gaps)
    assert gaps["early"] > 100 * bench.EARLY_RELATIVE


def test_report_and_verdicts(bench: ModuleType, result: dict[str, Any]) -> None:
    lines = bench.report(result)
    text = "\n".join(lines)
    assert "| (b) FSDP2 + fo.adamw |" in text
    assert "fused=True" in text
    assert text.count("\n| 1 |") == 1  # the curve table starts at step 1
    checks = bench.verdicts(result)
    assert len(checks) == 2
    assert all(line.startswith("PASS") for line in checks), checks
    # A gap of 1e-5 relative at step 5 (10x the early bound) must fail the (a)-(b) verdict.
    broken = deepcopy(result)
    curve = broken["methods"][bench.FSDP2_FO]["curve"]
    curve[4] *= 1 + 1e-5
    assert bench.verdicts(broken)[0].startswith("FAIL")
    assert bench.verdicts(broken)[1].startswith("FAIL")  # (b) is no longer bitwise (c)


def test_unknown_methods_are_rejected_before_spawning(bench: ModuleType) -> None:
    with pytest.raises(ValueError, match="distinct names"):
        bench.compare(bench.QUICK, ("DDP",))
    with pytest.raises(ValueError, match="distinct names"):
        bench.compare(bench.QUICK, (bench.FSDP2_FO, bench.FSDP2_FO))
