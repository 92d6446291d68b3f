"""The report of ``lm_diloco.py``: per-seed rows, mean +/- std over seeds, targets, the PNG.

Results come in as ``world size -> seed -> method -> result`` (``lm_diloco._train``'s dicts, or
``{"skipped": reason}``). Relative figures ("vs DDP") are taken per seed against that seed's
DDP run, then averaged; the standard deviation is the sample one (n - 1) over the seeds.
Private to the benchmarks (``_``-prefixed).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

Results = dict[int, dict[int, dict[str, Any]]]  # world -> seed -> method -> result


def load_logs(paths: list[str], worlds: list[int], seeds: list[int], names: list[str]) -> Results:
    """Results from ``lm_diloco.py --log`` files (a later line for a run replaces an earlier).

    Raises:
        ValueError: if a (world, seed, method) asked for is in none of the files.
    """
    import json

    found: dict[tuple[int, int, str], dict[str, Any]] = {}
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            key = (entry.pop("world"), entry.pop("seed"), entry.pop("method"))
            found[key] = entry
    missing = [
        k for k in ((w, s, n) for w in worlds for s in seeds for n in names) if k not in found
    ]
    if missing:
        raise ValueError(f"the logs hold no run for (world, seed, method) {missing}")
    return {w: {s: {n: found[(w, s, n)] for n in names} for s in seeds} for w in worlds}


def mb(count: float) -> str:
    return f"{count / 1e6:,.2f} MB"


def fraction(part: float, whole: float) -> str:
    if part == whole:
        return "1"
    return f"1/{whole / part:.1f}" if part else "0"


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(by_seed: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: mean/std of loss and of loss vs DDP (%), bytes (first seed), seeds' values."""
    names = list(next(iter(by_seed.values())))
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [(seed, by_seed[seed][name], by_seed[seed].get("DDP", {})) for seed in by_seed]
        if any("skipped" in run for _, run, _ in runs):
            out[name] = {"skipped": next(r["skipped"] for _, r, _ in runs if "skipped" in r)}
            continue
        losses = [run["loss"] for _, run, _ in runs]
        gaps = [100 * (run["loss"] / ddp["loss"] - 1) for _, run, ddp in runs if "loss" in ddp]
        first, ddp = runs[0][1], runs[0][2]
        out[name] = {
            "seeds": [seed for seed, _, _ in runs],
            "losses": losses,
            "gaps": gaps,
            "loss": statistics.fmean(losses),
            "loss_std": _std(losses),
            "gap": statistics.fmean(gaps) if gaps else None,
            "gap_std": _std(gaps) if gaps else None,
            "bytes": first["bytes"],
            "steady_bytes": first["steady_bytes"],
            "steady_wire": first["steady_wire"],
            "share": first["bytes"] / ddp["bytes"] if "bytes" in ddp else None,
            "peak": first["peak"],
            "seconds": statistics.fmean(run["seconds"] for _, run, _ in runs),
            "own_count": first["own_count"],
        }
    return out


def mean_rows(world: int, summary: dict[str, dict[str, Any]], notes: dict[str, str]) -> list[Any]:
    ddp = summary.get("DDP", {})
    rows: list[list[str]] = []
    for name, s in summary.items():
        if "skipped" in s:
            rows.append([name, str(world), "skipped", "", "", "", "", "", "", s["skipped"]])
            continue
        note = notes.get(name, "")
        if s["own_count"] not in (None, s["bytes"]):
            note += f"; averager's own count {s['own_count']:,} B"
        rows.append(
            [
                name,
                str(world),
                f"{s['loss']:.4f} ± {s['loss_std']:.4f}",
                ""
                if name == "DDP" or s["gap"] is None
                else f"{s['gap']:+.2f} ± {s['gap_std']:.2f}%",
                " / ".join(f"{g:+.1f}" for g in s["gaps"]) if name != "DDP" else "",
                mb(s["bytes"]),
                fraction(s["bytes"], ddp["bytes"]) if "bytes" in ddp else "",
                fraction(s["steady_wire"], ddp["steady_wire"]) if "bytes" in ddp else "",
                f"{s['seconds']:.1f}",
                note,
            ]
        )
    return rows


MEAN_HEADERS = [
    "method",
    "ranks",
    "held-out loss (mean ± std)",
    "vs DDP (mean ± std)",
    "vs DDP per seed (%)",
    "payload / rank",
    "payload / DDP",
    "after step 1: ring wire / DDP",
    "wall (s, mean)",
    "notes",
]


def seed_rows(world: int, by_seed: dict[int, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for seed, results in by_seed.items():
        ddp = results.get("DDP", {})
        for name, r in results.items():
            if "skipped" in r:
                continue
            gap = f"{100 * (r['loss'] / ddp['loss'] - 1):+.2f}%" if "loss" in ddp else ""
            rows.append(
                [
                    name,
                    str(world),
                    str(seed),
                    f"{r['loss']:.4f}",
                    gap,
                    mb(r["bytes"]),
                    mb(r["peak"]),
                    f"{r['seconds']:.1f}",
                ]
            )
    return rows


SEED_HEADERS = [
    "method",
    "ranks",
    "seed",
    "held-out loss",
    "vs DDP",
    "payload / rank",
    "peak / step",
    "wall (s)",
]


def targets(world: int, summary: dict[str, dict[str, Any]], period: int) -> list[str]:
    """The issue's targets on the means over seeds."""

    def ok(flag: bool) -> str:
        return "**met**" if flag else "**missed**"

    ran = {n: s for n, s in summary.items() if "skipped" not in s and n != "DDP"}
    cheap = {
        n: s for n, s in ran.items() if s["share"] is not None and s["share"] <= 1 / period * 1.0001
    }
    lines = []
    if cheap:
        best_name = min(cheap, key=lambda n: cheap[n]["gap"])
        best = cheap[best_name]
        lines.append(
            f"- {world} ranks: best variant at <= 1/{period} of DDP's bytes: {best_name}, "
            f"{best['gap']:+.2f} ± {best['gap_std']:.2f}% vs DDP at {fraction(best['share'], 1)} "
            f"of its bytes (target within 2%: {ok(best['gap'] <= 2.0)})"
        )
        plsgd = ran.get("post-local SGD")
        if plsgd is not None and best_name != "post-local SGD":
            margin = plsgd["gap"] - best["gap"]
            spread = max(best["gap_std"], plsgd["gap_std"])
            lines.append(
                f"- {world} ranks: {best_name} vs post-local SGD: {margin:.2f} points better "
                f"(twice the larger seed std: {2 * spread:.2f}; target more than that: "
                f"{ok(margin > 2 * spread)})"
            )
    muloco, ddp_muon = ran.get("MuLoCo"), summary.get("DDP + Muon")
    if muloco is not None and ddp_muon is not None and "losses" in ddp_muon:
        gaps = [100 * (a / b - 1) for a, b in zip(muloco["losses"], ddp_muon["losses"])]
        lines.append(
            f"- {world} ranks: MuLoCo vs DDP + Muon (the same inner optimizer, gradients every "
            f"step): {statistics.fmean(gaps):+.2f} ± {_std(gaps):.2f}%"
        )
    diloco = ran.get("DiLoCo")
    for name, s in ran.items():
        if diloco is None or s["share"] is None or s["share"] > 1 / 200 or name == "DiLoCo":
            continue
        diff = s["gap"] - diloco["gap"]
        lines.append(
            f"- {world} ranks: {name} at {fraction(s['share'], 1)} of DDP's bytes (<= 1/200): "
            f"{diff:+.2f} points vs DiLoCo's loss gap (target within 1 point: "
            f"{ok(abs(diff) <= 1.0)})"
        )
    return lines


def plot(by_world: dict[int, dict[str, Any]], path: Path) -> None:
    """Held-out loss against bytes and wall time, one row per world size (one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(by_world), 2, figsize=(11.0, 3.6 * len(by_world)), squeeze=False)
    for row, (world_size, results) in enumerate(sorted(by_world.items())):
        for name, result in results.items():
            if "skipped" in result:
                continue
            points = result["points"][1:]  # from the first evaluation after step 0
            losses = [p["loss"] for p in points]
            axes[row][0].plot(
                [max(p["bytes"], 1.0) for p in points], losses, marker=".", label=name
            )
            axes[row][1].plot([p["seconds"] for p in points], losses, marker=".", label=name)
        axes[row][0].set_xscale("log")
        axes[row][0].set_xlabel("payload bytes sent per rank")
        axes[row][1].set_xlabel("training wall time (s, slowest rank)")
        for ax in axes[row]:
            ax.set_ylabel(f"held-out loss, {world_size} ranks")
            ax.grid(True, which="both", alpha=0.3)
        axes[row][1].legend(fontsize=7)
    fig.suptitle("Byte-level transformer on the stdlib sources: held-out loss (nats/byte)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
