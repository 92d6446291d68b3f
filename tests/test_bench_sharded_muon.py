"""benchmarks/sharded_muon.py: Muon on FSDP2 and under DDP, side by side (issue 23, item 3).

One ``--quick --worlds 2`` run (2 gloo ranks, the first model) feeds the smoke tests: every
table has every contender's row, ours and the naive all-gather step leave bitwise equal params,
the measured bytes of the naive step and of ZeRO are what those collectives must send, and each
peer row either has its numbers or says why it could not run (without the peer installed: "not
installed").
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

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
WORLD = 2

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    # Imported by its own name: the spawned ranks unpickle ``sharded_muon._measure`` by that
    # name, from the parent's sys.path (which holds benchmarks/ while the module's tests run).
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("sharded_muon")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def tables(bench: ModuleType) -> dict[str, Any]:
    run_all = importlib.import_module("run_all")  # benchmarks/ is on sys.path while bench lives
    markdown = bench.main(["--quick", "--worlds", str(WORLD)])
    fsdp, peers, ddp = run_all.parse_tables(markdown)
    return {"fsdp": fsdp, "peers": peers, "ddp": ddp, "markdown": markdown}


def _numbers(cells: list[str]) -> list[float]:
    values = [float(cell.rstrip("x")) for cell in cells]
    assert all(math.isfinite(v) for v in values), cells
    return values


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def test_fsdp2_rows_and_ours_equals_naive_bitwise(
    bench: ModuleType, tables: dict[str, Any]
) -> None:
    table = tables["fsdp"]
    assert tuple(table.headers) == bench.FSDP_HEADERS
    col = {name: k for k, name in enumerate(table.headers)}
    assert [(row[0], row[1]) for row in table.rows] == [
        (str(WORLD), label) for label, _ in bench.QUICK.models
    ]
    for row, (_, shapes) in zip(table.rows, bench.QUICK.models, strict=True):
        assert row[col["max abs(ours - naive)"]] == "0"  # ":g" prints nothing else for 0.0
        ours, naive, adamw, ratio = _numbers(row[3:7])
        assert min(ours, naive, adamw) > 0
        assert ratio == pytest.approx(ours / naive, abs=0.01)
        assert row[col["target"]].startswith(f"<= {bench.TARGETS[WORLD]:.2f}: ")
        numel = sum(m * n for m, n in shapes)
        # the naive step all-gathers every fp32 matrix: each shard to the other rank
        assert row[col["naive MB/step"]] == _mb(numel * 4 * (WORLD - 1))
        assert 0 < float(row[col["ours MB/step"]]) < float(row[col["naive MB/step"]])


def test_each_peer_has_numbers_or_its_error(bench: ModuleType, tables: dict[str, Any]) -> None:
    table = tables["peers"]
    assert tuple(table.headers) == bench.PEER_HEADERS
    expected = [(label, peer.label) for label, _ in bench.QUICK.models for peer in bench.PEERS]
    assert [(row[1], row[2]) for row in table.rows] == expected
    by_label = {peer.label: peer for peer in bench.PEERS}
    for row in table.rows:
        peer, error = by_label[row[2]], row[-1]
        if importlib.util.find_spec(peer.module) is None:
            assert error == f"not installed (pip install {peer.pip})"
        if error:
            assert row[3:7] == ["n/a"] * 4
            assert ":" in error or error.startswith("not installed"), error
        else:
            ms, ratio, mb, diff = _numbers(row[3:7])
            assert min(ms, ratio, mb) > 0
            assert diff < 0.1  # the same Muon, up to its own bfloat16 rounding


def test_ddp_rows_agree_bitwise_and_count_bytes(bench: ModuleType, tables: dict[str, Any]) -> None:
    table = tables["ddp"]
    assert tuple(table.headers) == bench.DDP_HEADERS
    expected = [(label, name) for label, _ in bench.QUICK.models for name in bench.DDP_CONTENDERS]
    assert [(row[1], row[2]) for row in table.rows] == expected
    shapes = dict(bench.QUICK.models)
    for row in table.rows:
        ms, vs, mb, imbalance, diff = _numbers(row[3:8])
        assert min(ms, vs) > 0
        assert imbalance >= 1.0
        assert diff == 0.0  # torch.optim.Muon on every matrix, whoever owns it
        if row[2].startswith("ZeRO"):  # every updated fp32 matrix to the other rank, once
            numel = sum(m * n for m, n in shapes[row[1]])
            assert mb == float(_mb(numel * 4 * (WORLD - 1)))


def test_a_peer_that_is_missing_says_what_to_install(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    peers = sys.modules["_muon_peers"]
    peer = bench.PEERS[0]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == peer.module else find_spec(name, *a),
    )
    with pytest.raises(ModuleNotFoundError) as info:
        peers.build_peer(peer, [], [], bench.MUON)
    assert peers.short_error(info.value) == f"not installed (pip install {peer.pip})"
    long = ValueError("a | b\n" + "c" * 500)
    text = peers.short_error(long)
    assert text.startswith("ValueError: a / b c")
    assert len(text) <= 160
    assert "\n" not in text
