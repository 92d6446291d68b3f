"""Benchmark: the memory a pure step keeps, against torch's in-place Adam in the same run.

Each variant runs in a fresh spawned process (so that no allocator state carries over): it
makes 10M float32 params in 100 tensors (1M with ``--quick``) and their gradients, runs ten
Adam steps, and reports the resident memory above the process's before the params were made
(``/proc/self/statm``, after glibc's ``malloc_trim`` so that memory the allocator merely
caches is not counted), and the peak resident memory above it (``VmHWM``, reset at the
baseline):

* ``torch``: ``torch.optim.Adam(fused=True)`` in place: params, gradients, two moments;
* ``pure_step``: ``fo.pure_step(fo.adam)``, ``params, state = step(params, grads, state)``:
  it keeps one spare set of params and moments for reuse between steps;
* ``update + apply_updates``: the per-leaf pure path, fresh tensors every step.

Linux only (``/proc``); elsewhere the table says so. Usage:
``python benchmarks/pure_step_memory.py [--quick]``; ``main(argv) -> str`` returns the table.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import os
from typing import Any

import torch

from _harness import benchmark_parser, table

STEPS = 10
TENSORS = 100
HEADERS = ("variant", "resident MB", "x torch", "peak MB", "x torch")
VARIANTS = ("torch", "pure_step", "update + apply_updates")


def _resident_mb() -> float:
    """Resident memory now, after giving the allocator's free pages back (glibc)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak() -> None:
    """Restart the peak (``VmHWM``) from the current resident memory (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _run(variant: str, total: int, out: Any) -> None:
    """Child process: measure one variant and put ``(resident, peak)`` MB on ``out``."""
    import functional_optim as fo

    torch.set_num_threads(1)
    tx = fo.adam(lr=1e-4)
    base = _resident_mb()
    _reset_peak()
    base_peak = _peak_mb()
    gen = torch.Generator().manual_seed(0)
    size = total // TENSORS
    params = [torch.randn(size, generator=gen) for _ in range(TENSORS)]
    grads = [torch.randn(size, generator=gen) * 1e-2 for _ in range(TENSORS)]
    if variant == "torch":
        leaves = [p.requires_grad_(True) for p in params]
        for leaf, g in zip(leaves, grads, strict=True):
            leaf.grad = g
        opt = torch.optim.Adam(leaves, lr=1e-4, fused=True)
        for _ in range(STEPS):
            opt.step()
    elif variant == "update + apply_updates":
        state = tx.init(params)
        for _ in range(STEPS):
            updates, state = tx.update(grads, state, params)
            params = fo.apply_updates(params, updates)
    else:
        step = fo.pure_step(tx)
        state = tx.init(params)
        for _ in range(STEPS):
            params, state = step(params, grads, state)
    out.put((_resident_mb() - base, _peak_mb() - base_peak))


def _measure(variant: str, total: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run, args=(variant, total, out))
    proc.start()
    try:
        result: tuple[float, float] = out.get(timeout=300)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return result


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark and return its markdown table."""
    args = benchmark_parser(__doc__, "1M params").parse_args(argv)
    total = 1_000_000 if args.quick else 10_000_000
    title = (
        f"### Memory of a pure step: {total / 1e6:g}M float32 params in {TENSORS} tensors, "
        f"{STEPS} Adam steps, each variant in a fresh process"
    )
    if not os.path.exists("/proc/self/statm"):
        return "\n".join([title, "", "skipped: needs Linux's /proc/self/statm"])
    measured = {name: _measure(name, total) for name in VARIANTS}
    torch_resident, torch_peak = measured["torch"]
    rows = [
        [
            name,
            f"{resident:.0f}",
            f"{resident / torch_resident:.2f}",
            f"{peak:.0f}",
            f"{peak / torch_peak:.2f}",
        ]
        for name, (resident, peak) in measured.items()
    ]
    return "\n".join([title, "", *table(HEADERS, rows, "lrrrr")])


if __name__ == "__main__":
    print(main())
