"""The demo (examples/demo.py) end to end at --quick size, and the benchmark runner's report.

One demo run (three torchrun jobs, 2 processes each) feeds every distributed test below: it
must train, write its report files, leave no process behind, and our runs must follow torch's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_TIMEOUT_S = 300


def _load(path: Path) -> ModuleType:
    """Import a script by path (examples/ and benchmarks/ are folders, not packages)."""
    spec = importlib.util.spec_from_file_location(f"_under_test_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(f"{cmdline.parent.name}: {args}")
    return found


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("demo-out")
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="160")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "demo.py"),
            *("--quick", "--world-size", "2", "--out", str(out), "--timeout", "240"),
        ],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout}\n{proc.stderr}"
    runs = json.loads((out / "metrics.json").read_text())["runs"]
    return {"out": out, "stdout": proc.stdout, "stderr": proc.stderr, "runs": runs}


def _run(demo_run: dict[str, Any], name: str) -> dict[str, Any]:
    matches = [run for run in demo_run["runs"] if run["run"] == name]
    assert len(matches) == 1, [run["run"] for run in demo_run["runs"]]
    return matches[0]


def _assert_decreases(losses: list[float]) -> None:
    quarter = max(1, len(losses) // 4)
    first = sum(losses[:quarter]) / quarter
    last = sum(losses[-quarter:]) / quarter
    assert last < 0.9 * first, losses


@pytest.mark.distributed
def test_demo_writes_table_plot_and_leaves_no_process(demo_run: dict[str, Any]) -> None:
    out: Path = demo_run["out"]
    assert f"output folder: {out}" in demo_run["stdout"]
    for header in ("test acc", "step ms", "vs torch", "state/rank", "comm/step"):
        assert header in demo_run["stdout"]
    png = (out / "loss_curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(png) > 10_000
    summary = (out / "summary.md").read_text()
    assert summary.count("\n| ") == 1 + len(demo_run["runs"])  # header + one row per run
    assert not _processes_mentioning(str(out))
    # Warnings are errors in the suite; the demo's own output must be free of them too.
    assert "Warning" not in demo_run["stderr"], demo_run["stderr"]


@pytest.mark.distributed
def test_every_run_trains(demo_run: dict[str, Any]) -> None:
    assert len(demo_run["runs"]) == 7
    for run in demo_run["runs"]:
        _assert_decreases(run["losses"])
        assert len(run["step_times_ms"]) == len(run["losses"]) > 0
        assert all(bytes_ > 0 for bytes_ in run["opt_state_bytes_per_rank"])


@pytest.mark.distributed
def test_zero_matches_torch_zero(demo_run: dict[str, Any]) -> None:
    torch_run, ours = _run(demo_run, "ZeRO Adam (torch)"), _run(demo_run, "ZeRO Adam (ours)")
    # Same seeds, batches and Adam arithmetic: the curves agree to float32 rounding.
    assert ours["losses"] == pytest.approx(torch_run["losses"], rel=1e-5, abs=1e-6)
    # Each rank holds the state of its own shard only; together they hold all of it.
    assert ours["opt_state_bytes_per_rank"] == torch_run["opt_state_bytes_per_rank"]
    assert max(ours["opt_state_bytes_per_rank"]) < ours["opt_state_bytes_unsharded"]


@pytest.mark.distributed
def test_post_local_sgd_matches_torch_and_communicates_less(demo_run: dict[str, Any]) -> None:
    torch_run = _run(demo_run, "post-local SGD (torch)")
    ours = _run(demo_run, "post-local SGD (ours)")
    plain = _run(demo_run, "plain DDP")
    # Local steps amplify rounding differences a little; same algorithm, same schedule.
    assert ours["losses"] == pytest.approx(torch_run["losses"], rel=1e-4, abs=1e-5)
    assert ours["comm_bytes_per_step"] < plain["comm_bytes_per_step"]
    assert ours["losses"][: ours["extra"]["warmup"]] == pytest.approx(
        plain["losses"][: ours["extra"]["warmup"]], rel=1e-5
    )


@pytest.mark.distributed
def test_rpc_parameter_server_matches_torch(demo_run: dict[str, Any]) -> None:
    torch_run = _run(demo_run, "DistOptim Adam (torch)")
    ours = _run(demo_run, "DistOptim Adam (ours)")
    # One trainer (world size 2): both runs are deterministic and must coincide.
    assert ours["losses"] == pytest.approx(torch_run["losses"], rel=1e-5, abs=1e-6)
    assert ours["test_accuracy"] > 0.5


@pytest.mark.distributed
def test_ours_side_names_its_source(demo_run: dict[str, Any]) -> None:
    for run in demo_run["runs"]:
        for source in run["implementation"].values():
            if run["side"] == "ours":
                assert source.startswith("compat_api.") or source.endswith("(stand-in)"), source
            else:
                assert source.startswith("torch."), source


def test_demo_rejects_bad_options() -> None:
    demo = _load(ROOT / "examples" / "demo.py")
    for argv in (["--world-size", "1"], ["--epochs", "0"], ["--phases", "zero,nope"]):
        with pytest.raises(SystemExit):
            demo.parse_args(argv)
    assert demo.parse_args(["--quick"]).world_size == 2
