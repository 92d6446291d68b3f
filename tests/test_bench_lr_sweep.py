"""benchmarks/lr_sweep.py's correctness check, and how benchmarks/run_all.py reports a failed one.

The check trains the sweep in float64 (where the separate, vmapped and torch runs agree to
rounding at every rate) and must pass at the full sizes, where float32 runs disagree by 1e-4 at
the top rate (issue 28), yet catch an update that is wrong only under ``vmap``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lr_sweep() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHMARKS))  # it imports _harness by name, as run_all.py lets it
    try:
        yield _load(BENCHMARKS / "lr_sweep.py", "_under_test_lr_sweep")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _wrong_under_vmap(**change: float) -> Any:
    """``fo.adamw``, but with ``change`` applied when ``lr`` is a tensor (the vmapped run only)."""

    def make_tx(lr: Tensor | float, weight_decay: float) -> fo.GradientTransformation:
        if not isinstance(lr, Tensor):
            return fo.adamw(lr=lr, weight_decay=weight_decay)
        lr = lr * change.get("lr_factor", 1.0)
        weight_decay = change.get("weight_decay", weight_decay)
        return fo.adamw(lr=lr, weight_decay=weight_decay, eps=change.get("eps", 1e-8))

    return make_tx


def test_check_passes_at_the_full_sizes(lr_sweep: ModuleType) -> None:
    # The sizes of the failing run: hidden 4096, 20 steps, rates up to 0.1 (the loss diverges).
    lr_sweep.check_sweep(4096, 20)


@pytest.mark.parametrize(
    "change",
    [{"lr_factor": 1 + 1e-6}, {"weight_decay": 0.0}, {"eps": 1e-7}],
    ids=["lr off by 1e-6", "no weight decay", "eps 1e-7"],
)
def test_check_catches_an_update_wrong_only_under_vmap(
    lr_sweep: ModuleType, change: dict[str, float]
) -> None:
    lr_sweep.check_sweep(64, 5, make_tx=_wrong_under_vmap())  # unchanged: passes
    with pytest.raises(AssertionError, match=r"fo\.adamw vmap vs torch AdamW x8 \(hidden 64"):
        lr_sweep.check_sweep(64, 5, make_tx=_wrong_under_vmap(**change))


def test_check_catches_a_wrong_separate_update(lr_sweep: ModuleType) -> None:
    def make_tx(lr: Tensor | float, weight_decay: float) -> fo.GradientTransformation:
        lr = lr if isinstance(lr, Tensor) else lr * (1 + 1e-6)
        return fo.adamw(lr=lr, weight_decay=weight_decay)

    with pytest.raises(AssertionError, match=r"fo\.adamw x8 \(pure\) vs torch AdamW x8"):
        lr_sweep.check_sweep(64, 5, make_tx=make_tx)


def test_the_sweeps_differ_only_by_rounding_in_float64(lr_sweep: ModuleType) -> None:
    sweeps = lr_sweep._sweeps(64, 5, torch.float64)
    losses = {name: sweep() for name, sweep in sweeps.items()}
    assert {loss.dtype for loss in losses.values()} == {torch.float64}
    reference = losses[lr_sweep.TORCH]
    assert reference.shape == (lr_sweep.N_LRS,)
    assert len(set(reference.tolist())) == lr_sweep.N_LRS  # each rate trains differently
    for loss in losses.values():
        torch.testing.assert_close(loss, reference, rtol=1e-13, atol=0.0)


# -- benchmarks/run_all.py: a failed check fails the run and ends the report --------------------

_FAILING_CHECK = """
import torch

def _check():
    torch.testing.assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]),
                               msg=lambda m: f"fake sweep vs torch: {m}")

def main(argv=None):
    _check()
    return "| never | printed |"
"""
_PASSING = "def main(argv=None):\n    return '| a | ratio |\\n|---|---|\\n| x | 1.00 |\\n'\n"


def test_runner_ends_report_and_console_with_the_failed_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_all = _load(BENCHMARKS / "run_all.py", "_under_test_run_all")
    bench_dir = tmp_path / "bench"
    bench_dir.mkdir()
    (bench_dir / "fake_failing_check.py").write_text(_FAILING_CHECK)
    (bench_dir / "fake_passing.py").write_text(_PASSING)
    out = tmp_path / "out"
    names = "fake_failing_check,fake_passing"
    argv = ["--out", str(out), "--only", names, "--benchmarks-dir", str(bench_dir)]

    assert run_all.main(argv) == 1  # still a failure of the run, not a row
    report = (out / "REPORT.md").read_text()
    assert "| fake_failing_check | crashed |" in report
    assert "| fake_passing | ok |" in report
    failed = report.split("## Failed checks")
    assert len(failed) == 2  # one section, after every benchmark's own
    assert "## fake_passing" in failed[0]
    where = "bench/fake_failing_check.py:5 in _check: torch.testing.assert_close("
    assert where in failed[1]
    assert "AssertionError: fake sweep vs torch: Tensor-likes are not close!" in failed[1]
    assert "Mismatched elements: 1 / 2" in failed[1]
    err = capsys.readouterr().err
    last = err[err.rindex("## Failed checks") :]
    assert where in last
    assert "fake sweep vs torch" in last
    assert "fake_passing" not in last
