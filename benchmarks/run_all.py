"""Run every benchmark, ours vs torch in the same run, and write one markdown report.

Usage::

    python benchmarks/run_all.py [--quick] [--out bench-out] [--only zero_step,averaging]

Each benchmark module in this folder exposes ``main(argv) -> str`` (a markdown table whose
figures are ratios against torch measured in the same process). This runner calls each in turn,
gathers the tables under one header with the machine and versions, and draws a PNG of ratio vs
model size for every table that has a size column. A module that sets ``TAKES_OUT_FOLDER = True``
also gets ``--out <report folder>`` and may write its own charts there. A benchmark module that
does not exist yet is reported as missing; one that raises (a failed check: a benchmark checks
its results before it times them) is reported with its traceback, the report and the console
output end with which check failed (file, line, code, message), and the runner exits with status
1 after the report is written.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = (  # in order
    "step_throughput",
    "zero_step",
    "averaging",
    "rpc_step",
    "lm_diloco",
    "lowbit_states",
    "pure_step_speed",
)
SIZE_HEADER = re.compile(r"\b(size|params?|parameters|numel|elements|tensors)\b", re.IGNORECASE)
RATIO_HEADER = re.compile(
    r"ratio|vs\.? torch|speed-?up|/ ?torch|\bx torch|\u00d7 ?torch", re.IGNORECASE
)
_SUFFIX = {"k": 1e3, "m": 1e6, "g": 1e9, "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30}
_NUMBER = re.compile(r"^([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)\s*(k|m|g|kib|mib|gib)?\s*[x%]?$", re.I)


@dataclass
class Outcome:
    """What running one benchmark gave."""

    name: str
    status: str  # "ok", "missing" or "crashed"
    seconds: float = 0.0
    markdown: str = ""
    error: str = ""
    failure: str = ""  # a crash: where it raised and the message (see failure_summary)
    charts: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class Table:
    """A markdown table: header cells and rows of cells."""

    headers: list[str]
    rows: list[list[str]]


def parse_number(cell: str) -> float | None:
    """Read ``"1,024"``, ``"10M"``, ``"1.5 MiB"``, ``"0.97x"``, ``"12%"``, ``"**1.2**"``."""
    text = cell.strip().strip("*`").replace(",", "").replace("_", "")
    match = _NUMBER.match(text)
    if match is None:
        return None
    value = float(match.group(1))
    suffix = match.group(2)
    return value * _SUFFIX[suffix.lower()] if suffix else value


def parse_tables(markdown: str) -> list[Table]:
    """Every pipe table in ``markdown`` (header row, separator row, body rows)."""
    tables: list[Table] = []
    lines = [line.strip() for line in markdown.splitlines()]
    i = 0
    while i < len(lines) - 1:
        is_table = lines[i].startswith("|") and re.fullmatch(r"\|?[\s:|-]+\|?", lines[i + 1])
        if not is_table or "-" not in lines[i + 1]:
            i += 1
            continue
        headers = _cells(lines[i])
        rows = []
        i += 2
        while i < len(lines) and lines[i].startswith("|"):
            rows.append(_cells(lines[i]))
            i += 1
        tables.append(Table(headers, [row for row in rows if len(row) == len(headers)]))
    return tables


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def our_rows(table: Table) -> list[list[str]]:
    """The rows about our implementation (a cell starting with "ours"), else every row."""
    ours = [row for row in table.rows if any(c.lower().startswith("ours") for c in row)]
    return ours or table.rows


def _numeric_like(cell: str) -> bool:
    """A number, or numbers separated by slashes (``"16 / 10"``, ``"32.0 / 0.9"``)."""
    return all(parse_number(part) is not None for part in cell.split("/"))


def _config_columns(
    table: Table, rows: list[list[str]], size_col: int, ratio_cols: list[int]
) -> list[int]:
    """Text columns that tell configurations apart at a given size (the lines of a chart).

    A column whose value follows from the size (a model name, a constant) would give each line
    a single point, so it is left out.
    """
    skip = {size_col, *ratio_cols}
    columns = []
    for col in range(len(table.headers)):
        cells = [row[col] for row in rows]
        if col in skip or any(_numeric_like(cell) for cell in cells if cell):
            continue
        values_per_size: dict[float | None, set[str]] = {}
        for row in rows:
            values_per_size.setdefault(parse_number(row[size_col]), set()).add(row[col])
        if any(len(values) > 1 for values in values_per_size.values()):
            columns.append(col)
    return columns


def ratio_series(table: Table) -> dict[str, list[tuple[float, float]]]:
    """``{label: [(size, ratio), ...]}`` for a table with a size column and ratio columns.

    Each line is one configuration across sizes, labelled by the text cells that vary at a
    fixed size (for example the optimizer and implementation), plus the ratio column's header
    when there are several.
    """
    size_cols = [i for i, h in enumerate(table.headers) if SIZE_HEADER.search(h)]
    ratio_cols = [i for i, h in enumerate(table.headers) if RATIO_HEADER.search(h)]
    if not size_cols or not ratio_cols:
        return {}
    size_col = size_cols[0]
    rows = [row for row in our_rows(table) if parse_number(row[size_col]) is not None]
    config_cols = _config_columns(table, rows, size_col, ratio_cols)
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        size = parse_number(row[size_col])
        assert size is not None
        parts = [
            f"{table.headers[col]}={row[col]}" if row[col] in ("True", "False") else row[col]
            for col in config_cols
        ]
        for col in ratio_cols:
            ratio = parse_number(row[col])
            if ratio is None:
                continue
            label = [*parts, table.headers[col]] if len(ratio_cols) > 1 or not parts else parts
            series.setdefault(" / ".join(label), []).append((size, ratio))
    return {key: sorted(points) for key, points in series.items() if len(points) > 1}


def ratio_summary(markdown: str) -> str:
    """``"header: min-max (geomean g)"`` for every ratio column of every table (our rows)."""
    parts = []
    for table in parse_tables(markdown):
        for col, header in enumerate(table.headers):
            if not RATIO_HEADER.search(header):
                continue
            values = [parse_number(row[col]) for row in our_rows(table)]
            positive = [v for v in values if v is not None and v > 0]
            if positive:
                geomean = math.exp(sum(math.log(v) for v in positive) / len(positive))
                parts.append(
                    f"{header}: {min(positive):.2f}-{max(positive):.2f} (geomean {geomean:.2f})"
                )
    return "; ".join(parts)


def plot_ratios(name: str, markdown: str, folder: Path) -> list[Path]:
    """Draw ratio vs size for each table of ``markdown`` that has both; return the PNG paths."""
    charts = []
    for index, table in enumerate(parse_tables(markdown)):
        series = ratio_series(table)
        if not series:
            continue
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker

        size_header = next(h for h in table.headers if SIZE_HEADER.search(h))
        fig, ax = plt.subplots(figsize=(9.0, 4.2))
        for label, points in series.items():
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label)
        ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle="--")
        ax.set_xscale("log")
        ax.set_yscale("log")  # ratios are multiplicative: 0.5x and 2x sit symmetric around 1
        low, high = ax.get_ylim()
        # Label every minor tick within a decade, only the 2s and 5s over wider ranges.
        label_digits = "123456789" if high / low < 10 else "25"
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.2g}x"))
        ax.yaxis.set_minor_formatter(
            ticker.FuncFormatter(
                lambda v, _, digits=label_digits: f"{v:.2g}x" if f"{v:e}"[0] in digits else ""
            )
        )
        ax.xaxis.set_major_formatter(ticker.EngFormatter())
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(size_header)
        ratio_headers = sorted({h for h in table.headers if RATIO_HEADER.search(h)})
        ax.set_ylabel(f"{', '.join(ratio_headers)} (ours / torch, same run)")
        ax.set_title(f"{name}: ratio vs {size_header}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        fig.tight_layout()
        path = folder / f"{name}_ratio_vs_size{'' if index == 0 else f'_{index}'}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        charts.append(path)
    return charts


def discover(directory: Path) -> list[str]:
    """The expected benchmarks, then any other module of ``directory`` that defines ``main``."""
    found = sorted(
        path.stem
        for path in directory.glob("*.py")
        if not path.stem.startswith("_")
        and path.stem != "run_all"
        and re.search(r"^def main\(", path.read_text(), re.MULTILINE)
    )
    return [*BENCHMARKS, *(name for name in found if name not in BENCHMARKS)]


def failure_summary(error: BaseException, directory: Path) -> str:
    """Which check raised: ``file:line in function``, the code line, and the exception.

    The place is the innermost frame in ``directory`` (the benchmark's own call of
    ``assert_close``, say, rather than torch's internals), else the innermost frame.
    """
    folder = directory.resolve()
    frames = traceback.extract_tb(error.__traceback__)
    ours = [frame for frame in frames if Path(frame.filename).resolve().is_relative_to(folder)]
    lines = []
    if frames:
        frame = (ours or frames)[-1]
        path = Path(frame.filename).resolve()
        shown = path.relative_to(folder.parent) if ours else path
        lines.append(f"{shown}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}")
    message = "".join(traceback.format_exception_only(type(error), error)).rstrip()
    return "\n".join([*lines, message])


def run_benchmark(name: str, argv: list[str], folder: Path, directory: Path = HERE) -> Outcome:
    """Import ``directory/name.py`` and call its ``main(argv)``; never raises."""
    if not (directory / f"{name}.py").exists():
        return Outcome(name, "missing", error=f"{directory.name}/{name}.py does not exist yet")
    # On sys.path while it runs, so that processes it spawns can import it by name too.
    sys.path.insert(0, str(directory))
    start = time.perf_counter()
    try:
        module = importlib.import_module(name)
        # A benchmark that writes files of its own (a chart) sets TAKES_OUT_FOLDER and gets the
        # report folder, so that the links in its markdown resolve next to the report.
        extra = ["--out", str(folder)] if getattr(module, "TAKES_OUT_FOLDER", False) else []
        markdown = module.main([*argv, *extra])
        if not isinstance(markdown, str):
            raise TypeError(f"{name}.main() returned {type(markdown).__name__}, expected str")
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # SystemExit from a benchmark's argparse counts as a crash too
        seconds = time.perf_counter() - start
        failure = failure_summary(error, directory)
        return Outcome(name, "crashed", seconds, error=traceback.format_exc(), failure=failure)
    finally:
        sys.path.remove(str(directory))
    seconds = time.perf_counter() - start
    outcome = Outcome(name, "ok", seconds, markdown=markdown.strip() + "\n")
    try:
        outcome.charts = plot_ratios(name, markdown, folder)
    except Exception:
        outcome.error = "chart failed:\n" + traceback.format_exc()
    return outcome


def machine_info() -> list[tuple[str, str]]:
    """CPU model, cores, memory, OS and the versions that matter for the figures."""
    import torch

    cpu = platform.processor() or platform.machine()
    memory = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return [
        ("CPU", cpu),
        ("cores (usable / total)", f"{usable} / {os.cpu_count()}"),
        ("memory", memory),
        ("GPU", gpu),
        ("OS", platform.platform()),
        ("Python", platform.python_version()),
        ("torch", torch.__version__),
        ("torch threads", str(torch.get_num_threads())),
        ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "unset")),
    ]


def failed_checks(outcomes: Sequence[Outcome]) -> list[str]:
    """The report's last section: each crashed benchmark and the check that raised; [] if none."""
    crashed = [outcome for outcome in outcomes if outcome.status == "crashed"]
    if not crashed:
        return []
    lines = ["## Failed checks", "", f"{len(crashed)} benchmark(s) raised; the run failed."]
    for outcome in crashed:
        lines += ["", f"### {outcome.name}", "", "```text", outcome.failure.rstrip(), "```"]
    return lines


def render_report(outcomes: Sequence[Outcome], quick: bool, folder: Path) -> str:
    """The report: machine, a summary row per benchmark, their tables, then any failed checks."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark report",
        "",
        f"{now}; {'--quick (smoke sizes, not for quoting)' if quick else 'full sizes'}. "
        "Every ratio is ours / torch measured in the same run on this machine.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in machine_info()),
        "",
        "## Summary",
        "",
        "| benchmark | status | seconds | ratios (min-max, geomean) |",
        "|---|---|---:|---|",
    ]
    for outcome in outcomes:
        lines.append(
            f"| {outcome.name} | {outcome.status} | {outcome.seconds:.1f} | "
            f"{ratio_summary(outcome.markdown) if outcome.status == 'ok' else ''} |"
        )
    for outcome in outcomes:
        lines += ["", f"## {outcome.name}", ""]
        if outcome.status == "missing":
            lines.append(f"Missing: {outcome.error}.")
            continue
        if outcome.status == "crashed":
            lines += ["**Crashed:**", "", "```text", outcome.error.rstrip(), "```"]
            continue
        lines.append(outcome.markdown.rstrip())
        for chart in outcome.charts:
            lines += ["", f"![{outcome.name} ratio vs size]({chart.relative_to(folder)})"]
        if outcome.error:
            lines += ["", "```text", outcome.error.rstrip(), "```"]
    failed = failed_checks(outcomes)
    if failed:
        lines += ["", *failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, write the report; return 1 if any benchmark crashed, else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument(
        "--out", default="bench-out", help="report folder (or a .md path) [bench-out]"
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated benchmark names (default: all)"
    )
    parser.add_argument(
        "--benchmarks-dir", default=str(HERE), help="folder of the benchmark modules [this one]"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    report = out if out.suffix == ".md" else out / "REPORT.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    outcomes = []
    names = args.only.split(",") if args.only else discover(Path(args.benchmarks_dir))
    for name in names:
        print(f"== {name}", flush=True)
        outcome = run_benchmark(
            name, ["--quick"] if args.quick else [], report.parent, Path(args.benchmarks_dir)
        )
        print(f"-- {name}: {outcome.status} ({outcome.seconds:.1f} s)", flush=True)
        outcomes.append(outcome)
    report.write_text(render_report(outcomes, args.quick, report.parent))
    print(f"wrote {report.resolve()}")
    crashed = [outcome for outcome in outcomes if outcome.status == "crashed"]
    for outcome in crashed:
        print(f"\nbenchmark {outcome.name} CRASHED:\n{outcome.error}", file=sys.stderr)
    if crashed:  # last, where a reader of the console looks first
        print("\n" + "\n".join(failed_checks(outcomes)), file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
