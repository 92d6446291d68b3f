"""Benchmark: optimizer step time on a CUDA GPU, ours vs torch (skipped without a GPU).

For 10M and 100M float32 parameters split into 100 and into 1000 equal tensors, it times one
step of Adam, AdamW, SGD-momentum, Lion and Muon:

* torch: ``torch.optim.X(foreach=True)`` and ``fused=True`` where torch has a fused kernel
  (Adam, AdamW, SGD); ``torch.optim.Muon`` (torch has only its per-tensor loop); for Lion, which
  torch.optim lacks, the three ``_foreach`` ops a user would write (``torch foreach``);
* ours in place: ``fo.Optimizer(params, fo.<alias>(...)).step()`` (what a user swaps in);
* ours pure: ``fo.pure_step(tx)(params, grads, state)`` (new params and state, inputs intact),
  with its default ~1 MiB chunks and with 1 GiB chunks (one chunk per model here).

The implementations run in alternating rounds (one step each, rotating order); each row is
the median wall time of a step (the device synchronised before and after) after warm-up, and
its ratio to torch's fastest in-place step on the same model (fused where torch has one, else
foreach; Muon: torch's only path). Muon's models hold square matrices of the same total size.

Usage: ``python benchmarks/gpu_step.py [--quick] [--repeats N]``; ``main(argv) -> str``
returns the markdown table (a one-line note when no CUDA device is present).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import functional_optim as fo
from _harness import benchmark_parser, table

LR = 1e-4
HEADERS = ("algorithm", "params", "tensors", "implementation", "ms/step", "x torch")
ALGORITHMS = ("Adam", "AdamW", "SGD-momentum", "Lion", "Muon")


def _shapes(total: int, n_tensors: int, matrix: bool) -> list[tuple[int, ...]]:
    size = total // n_tensors
    if not matrix:
        return [(size,)] * n_tensors
    side = math.isqrt(size)
    return [(side, side)] * n_tensors


def _make(shapes: list[tuple[int, ...]], device: str, seed: int = 0
          ) -> tuple[list[Tensor], list[Tensor]]:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(s, generator=gen, device=device) for s in shapes]
    grads = [torch.randn(s, generator=gen, device=device) * 1e-2 for s in shapes]
    return params, grads


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _torch_step(cls: type[torch.optim.Optimizer], params: list[Tensor], grads: list[Tensor],
                **kw: Any) -> Callable[[], None]:  # fmt: skip
    leaves = [p.clone().requires_grad_(True) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g.clone()
    opt = cls(leaves, **kw)
    return lambda: opt.step()  # type: ignore[func-returns-value]


def _torch_lion(params: list[Tensor], grads: list[Tensor]) -> Callable[[], None]:
    ps = [p.clone() for p in params]
    gs = [g.clone() for g in grads]
    mu = [torch.zeros_like(p) for p in ps]
    b1, b2, wd = 0.9, 0.99, 1e-3

    def step() -> None:
        direction = torch._foreach_lerp(mu, gs, 1 - b1)
        torch._foreach_sign_(direction)
        torch._foreach_add_(direction, ps, alpha=wd)
        torch._foreach_add_(ps, direction, alpha=-LR)
        torch._foreach_lerp_(mu, gs, 1 - b2)

    return step


def _ours_inplace(tx: fo.GradientTransformation, params: list[Tensor],
                  grads: list[Tensor]) -> Callable[[], None]:  # fmt: skip
    leaves = [p.clone().requires_grad_(True) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g.clone()
    opt = fo.Optimizer(leaves, tx)
    return lambda: opt.step()  # type: ignore[func-returns-value]


def _ours_pure(tx: fo.GradientTransformation, params: list[Tensor], grads: list[Tensor],
               **options: Any) -> Callable[[], None]:  # fmt: skip
    step = fo.pure_step(tx, **options)
    held: dict[str, Any] = {"p": [p.clone() for p in params]}
    held["s"] = tx.init(held["p"])
    gs = [g.clone() for g in grads]

    def run() -> None:
        held["p"], held["s"] = step(held["p"], gs, held["s"])

    return run


def _candidates(algorithm: str, params: list[Tensor], grads: list[Tensor]
                ) -> tuple[dict[str, Callable[[], None]], str]:  # fmt: skip
    """name -> step, and the name of torch's reference step."""
    out: dict[str, Callable[[], None]] = {}
    if algorithm in ("Adam", "AdamW", "SGD-momentum"):
        cls, kw, tx = {
            "Adam": (torch.optim.Adam, {"lr": LR}, fo.adam(lr=LR)),
            "AdamW": (torch.optim.AdamW, {"lr": LR}, fo.adamw(lr=LR)),
            "SGD-momentum": (
                torch.optim.SGD, {"lr": LR, "momentum": 0.9}, fo.sgd(lr=LR, momentum=0.9)
            ),
        }[algorithm]  # fmt: skip
        out["torch foreach"] = _torch_step(cls, params, grads, foreach=True, **kw)
        out["torch fused"] = _torch_step(cls, params, grads, fused=True, **kw)
        reference = "torch fused"
    elif algorithm == "Lion":
        tx = fo.lion(LR, weight_decay=1e-3)
        out["torch foreach"] = _torch_lion(params, grads)
        reference = "torch foreach"
    else:
        tx = fo.muon(lr=LR)
        out["torch Muon"] = _torch_step(torch.optim.Muon, params, grads, lr=LR)
        reference = "torch Muon"
    out["ours in place"] = _ours_inplace(tx, params, grads)
    out["ours pure"] = _ours_pure(tx, params, grads)
    if algorithm != "Muon":
        out["ours pure, 1 GiB chunks"] = _ours_pure(tx, params, grads, chunk_bytes=1 << 30)
    return out, reference


def _interleaved_ms(steps: dict[str, Callable[[], None]], device: str, warmup: int,
                    repeats: int) -> dict[str, float]:  # fmt: skip
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            steps[name]()
            _sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main(argv: list[str] | None = None) -> str:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=0, help="timed rounds per model")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        note = "gpu_step: skipped (no CUDA device on this machine)"
        print(note)
        return note
    totals = (1_000_000,) if args.quick else (10_000_000, 100_000_000)
    repeats = args.repeats or (5 if args.quick else 21)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU dry run"
    rows: list[tuple[Any, ...]] = []
    for total in totals:
        for n_tensors in (100, 1000):
            for algorithm in ALGORITHMS:
                shapes = _shapes(total, n_tensors, matrix=algorithm == "Muon")
                params, grads = _make(shapes, args.device)
                steps, reference = _candidates(algorithm, params, grads)
                ms = _interleaved_ms(steps, args.device, warmup=3, repeats=repeats)
                count = sum(math.prod(s) for s in shapes)
                for name, value in ms.items():
                    ratio = value / ms[reference]
                    rows.append((algorithm, f"{count / 1e6:.0f}M", n_tensors, name,
                                 f"{value:.3f}", f"{ratio:.2f}"))  # fmt: skip
                del params, grads, steps
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    title = f"GPU optimizer step ({device_name}, torch {torch.__version__}, median of {repeats})"
    out = f"### {title}\n\n" + "\n".join(table(HEADERS, rows, "lrrlrr"))
    print(out)
    return out


if __name__ == "__main__":
    main()
