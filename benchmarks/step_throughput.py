"""Benchmark: optimizer step throughput, ours vs torch, for Adam, AdamW and SGD-momentum.

For 10M float32 parameters split into 100 and into 1000 tensors, it times one ``step`` of:

* torch: ``torch.optim.X`` default (per-tensor loop on CPU), ``foreach=True``, ``fused=True``
  (the reference for the ratio column) and ``torch.distributed.optim._FunctionalX``;
* ours: the kernel with ``impl="auto"`` on prebuilt lists, ``functional_optim.FunctionalX.step``
  and, when available, ``functional_optim.Optimizer(params, functional_optim.<alias>(...))``.

The implementations are timed in alternating rounds (one step each, rotating order), so load
changes on the shared machine hit all of them alike. Each row reports the median ms/step after
warm-up, the ratio to torch fused, and the effective
bandwidth (Adam/AdamW move >= 28 bytes/param: param r/w, grad r, two moments r/w; SGD-momentum
20) against a measured in-place streaming bandwidth (``a.mul_(b)``, 12 bytes/element).

Usage: ``python benchmarks/step_throughput.py [--quick] [--threads N] [--repeats N]``;
``main(argv) -> str`` returns the markdown table.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import functional_optim as fo
from _harness import benchmark_parser, interleaved_median_ms, median_call_ms, table
from functional_optim import kernels
from functional_optim.functional import FunctionalAdam, FunctionalAdamW, FunctionalSGD

LR = 1e-4
BYTES_PER_PARAM = {"Adam": 28, "AdamW": 28, "SGD-momentum": 20}
HEADERS = ("algorithm", "tensors", "implementation", "ms/step", "x torch fused", "GB/s", "% stream")


def _make(total: int, n_tensors: int, seed: int = 0) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    size = total // n_tensors
    params = [torch.randn(size, generator=gen) for _ in range(n_tensors)]
    grads = [torch.randn(size, generator=gen) * 1e-2 for _ in range(n_tensors)]
    return params, grads


def _stream_gbps(total: int, warmup: int, repeats: int) -> float:
    a, b = torch.rand(total), torch.rand(total) + 0.5
    b.reciprocal_()
    ms = median_call_ms(lambda: a.mul_(b), warmup, repeats)
    return 12 * total / (ms * 1e-3) / 1e9


def _torch_functional() -> dict[str, Any]:
    # Importing torch.distributed.optim and building its _FunctionalX warns (deprecations):
    # record=True keeps those out of the output.
    with warnings.catch_warnings(record=True):
        from torch.distributed.optim.functional_adam import _FunctionalAdam
        from torch.distributed.optim.functional_adamw import _FunctionalAdamW
        from torch.distributed.optim.functional_sgd import _FunctionalSGD
    return {"Adam": _FunctionalAdam, "AdamW": _FunctionalAdamW, "SGD-momentum": _FunctionalSGD}


def _hyper(algo: str) -> dict[str, Any]:
    return {"lr": LR, "momentum": 0.9} if algo == "SGD-momentum" else {"lr": LR}


def _torch_optim(algo: str, params: list[Tensor], grads: list[Tensor], **flags: Any) -> Any:
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD-momentum": torch.optim.SGD}
    leaves = [p.clone().requires_grad_(True) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g
    opt = cls[algo](leaves, **_hyper(algo), **flags)
    return opt.step


def _torch_twin(algo: str, params: list[Tensor], grads: list[Tensor]) -> Any:
    ps = [p.clone() for p in params]
    with warnings.catch_warnings(record=True):
        opt = _torch_functional()[algo](ps, **_hyper(algo))
    gs: list[Tensor | None] = list(grads)

    def step() -> None:
        with warnings.catch_warnings(record=True):
            opt.step(gs)

    return step


def _ours_kernel(algo: str, params: list[Tensor], grads: list[Tensor]) -> Any:
    ps = [p.clone() for p in params]
    if algo == "SGD-momentum":
        bufs: list[Tensor | None] = [None] * len(ps)
        return lambda: kernels.sgd(ps, grads, bufs, LR, 0.9, 0.0, 0.0, False, False)
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    steps = [torch.zeros((), dtype=torch.float32) for _ in ps]
    fn = kernels.adam if algo == "Adam" else kernels.adamw
    wd = 0.0 if algo == "Adam" else 1e-2
    return lambda: fn(ps, grads, m, v, [], steps, False, 0.9, 0.999, LR, wd, 1e-8, False)


def _ours_functional(algo: str, params: list[Tensor], grads: list[Tensor]) -> Any:
    ps = [p.clone() for p in params]
    cls = {"Adam": FunctionalAdam, "AdamW": FunctionalAdamW, "SGD-momentum": FunctionalSGD}
    opt = cls[algo](ps, **_hyper(algo))
    gs: list[Tensor | None] = list(grads)
    return lambda: opt.step(gs)


def _ours_optimizer(algo: str, params: list[Tensor], grads: list[Tensor]) -> Any:
    """``fo.Optimizer(params, fo.<alias>(...))`` (built by another part of the project)."""
    optimizer_cls = getattr(fo, "Optimizer", None)
    alias = getattr(fo, {"Adam": "adam", "AdamW": "adamw", "SGD-momentum": "sgd"}[algo], None)
    if optimizer_cls is None or alias is None:
        raise RuntimeError("functional_optim.Optimizer / alias not available yet")
    leaves = [p.clone().requires_grad_(True) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g
    opt = optimizer_cls(leaves, alias(**_hyper(algo)))
    return opt.step


ROWS: list[tuple[str, Callable[..., Any]]] = [
    ("torch default", lambda a, p, g: _torch_optim(a, p, g)),
    ("torch foreach=True", lambda a, p, g: _torch_optim(a, p, g, foreach=True)),
    ("torch fused=True", lambda a, p, g: _torch_optim(a, p, g, fused=True)),
    ("torch _FunctionalX", _torch_twin),
    ("ours kernel (auto)", _ours_kernel),
    ("ours FunctionalX.step", _ours_functional),
    ("ours fo.Optimizer", _ours_optimizer),
]


def _rescale_stream(line: str, stream: float, ratio: float) -> str:
    """Rewrite a table line for a better streaming measurement (header and % column)."""
    if line.startswith("In-place streaming bandwidth"):
        return f"In-place streaming bandwidth (`a.mul_(b)`, 12 B/elem): {stream:.1f} GB/s."
    cells = line.split(" | ")
    if len(cells) == 7 and cells[-1].endswith("% |"):
        cells[-1] = f"{float(cells[-1][:-3]) * ratio:.0f}% |"
    return " | ".join(cells)


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark and return its markdown table."""
    parser = benchmark_parser(__doc__, "1M params, few repeats")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    total = 1_000_000 if args.quick else 10_000_000
    repeats = args.repeats or (5 if args.quick else 15)
    layouts = (100, 1000)

    stream = _stream_gbps(total, args.warmup, repeats)
    lines = [
        f"### Optimizer step throughput: {total / 1e6:g}M float32 params, "
        f"{args.threads} thread(s), median of {repeats} alternating rounds",
        "",
        f"In-place streaming bandwidth (`a.mul_(b)`, 12 B/elem): {stream:.1f} GB/s.",
        "",
    ]
    rows: list[list[object]] = []
    notes: list[str] = []
    for algo in ("Adam", "AdamW", "SGD-momentum"):
        for n in layouts:
            params, grads = _make(total, n)
            steps: dict[str, Callable[[], Any]] = {}
            for label, build in ROWS:
                try:
                    steps[label] = build(algo, params, grads)
                except Exception as err:  # a missing row must not stop the run
                    notes.append(f"{label} / {algo} / {n}: skipped ({type(err).__name__}: {err})")
            with torch.no_grad():
                medians = interleaved_median_ms(steps, args.warmup, repeats)
            del steps
            results: list[tuple[str, float | None]] = [
                (label, medians.get(label)) for label, _ in ROWS
            ]
            fused: float | None = dict(results)["torch fused=True"]
            for label, maybe_ms in results:
                if maybe_ms is None:
                    rows.append([algo, n, label, "n/a", "", "", ""])
                    continue
                ms = maybe_ms
                gbps = BYTES_PER_PARAM[algo] * total / (ms * 1e-3) / 1e9
                ratio = f"{ms / fused:.2f}" if fused else ""
                rows.append(
                    [
                        algo,
                        n,
                        label,
                        f"{ms:.2f}",
                        ratio,
                        f"{gbps:.1f}",
                        f"{100 * gbps / stream:.0f}%",
                    ]
                )
    lines += table(HEADERS, rows, "lrlrrrr")
    # The CPU is shared: take the better of a streaming measurement before and after the rows.
    stream_after = _stream_gbps(total, args.warmup, repeats)
    if stream_after > stream:
        scale = stream / stream_after
        lines = [_rescale_stream(line, stream_after, scale) for line in lines]
    if notes:
        lines += ["", "Notes:", *[f"- {n}" for n in sorted(set(notes))]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
