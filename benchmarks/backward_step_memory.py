"""Benchmark: peak memory and step time of optimizer-in-backward against step-after-backward.

An MLP of ``LAYERS`` square ``Linear(DIM, DIM)`` layers (~50M float32 params; ~4M with
``--quick``), batch 8 (activations are negligible: gradients and optimizer state dominate), one
thread. Each configuration runs in a fresh spawned process: it has glibc ``mmap`` every
allocation over 64 KiB (so freed tensors leave the resident set), builds the model, reads its
resident memory after glibc's ``malloc_trim`` (``/proc/self/statm``), runs ``WARMUP``
training steps (forward, backward, step: they create the optimizer state, and DDP rebuilds its
buckets), restarts the peak (``VmHWM``) and runs ``STEPS`` more. Reported: the peak resident
memory of those steps above the baseline (gradients + optimizer state + DDP buckets +
temporaries; the params themselves are not counted) and their median step time. Rounds of all
single-process configurations run interleaved (rotating order); each number is the median over
rounds. DDP runs 2 gloo ranks (one round; the larger of the two ranks' numbers).

* ``step after backward``: ``loss.backward(); opt.step(); opt.zero_grad()``, with torch's
  ``AdamW`` (the reference the ratios use) and with ``fo.Optimizer(fo.adamw)``;
* ``in backward``: :func:`dist_runtime.optimizer_in_backward` with ``fo.adamw``: each
  parameter steps from its hook and its gradient is freed at once;
* ``+ clip``: global-norm clipping to 1.0: ``clip_grad_norm_`` after backward, or in backward
  with ``clip_mode="two_pass"`` (gradients kept until backward ends) or ``"previous"``
  (clips with the previous step's norm, so gradients are still freed as they come);
* ``DDP``: the same with ``DistributedDataParallel`` (its default, and
  ``gradient_as_bucket_view=True``, where the gradients live in the buckets).

Linux only (``/proc``). Usage: ``python benchmarks/backward_step_memory.py [--quick]``;
``main(argv) -> str`` returns the table.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from _harness import benchmark_parser, spawn, table

WARMUP = 2
STEPS = 3
BATCH = 8
CONFIGS = (
    "step after backward, torch AdamW",
    "step after backward, fo.adamw",
    "in backward, fo.adamw",
    "step after backward + clip_grad_norm_, fo.adamw",
    "in backward + clip two_pass, fo.adamw",
    "in backward + clip previous, fo.adamw",
)
DDP_CONFIGS = (
    "DDP: step after backward, fo.adamw",
    "DDP: in backward, fo.adamw",
    "DDP(gradient_as_bucket_view=True): step after backward, fo.adamw",
    "DDP(gradient_as_bucket_view=True): in backward, fo.adamw",
)
HEADERS = ("configuration", "peak MB", "x torch", "x same", "step ms", "x torch", "x same")
# "x same": against step after backward with the same optimizer (and the same clipping)
SAME = {c: CONFIGS[3] if "clip" in c else CONFIGS[1] for c in CONFIGS[1:]}


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _mmap_large_allocations() -> None:
    """Have glibc ``mmap`` every allocation over 64 KiB (``M_MMAP_THRESHOLD``), so a freed
    tensor leaves the resident set at once and the peak counts live tensors, not the free
    chunks glibc's dynamic threshold keeps on its heap (the default makes every variant look
    alike)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD


def _resident_mb() -> float:
    """Resident memory now, after giving the allocator's free pages back (glibc)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
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


def _train(config: str, dim: int, layers: int, ddp: bool) -> tuple[float, float]:
    """Train one configuration in this fresh process: ``(peak MB, median step s)``."""
    import functional_optim as fo
    from dist_runtime import optimizer_in_backward

    torch.set_num_threads(1)
    _mmap_large_allocations()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        *(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers))
    )
    x = torch.randn(BATCH, dim)
    clip = "clip" in config
    base = _resident_mb()
    _reset_peak()
    if ddp:  # its buckets (a gradient-sized buffer) count
        view = "gradient_as_bucket_view" in config
        model = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
    if "in backward" in config:
        mode = "two_pass" if "two_pass" in config else "previous"
        optimizer_in_backward(
            model, fo.adamw(1e-4), clip_grad_norm=1.0 if clip else None, clip_mode=mode
        )

        def step() -> None:
            model(x).square().mean().backward()

    else:
        params = list(model.parameters())
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(params, lr=1e-4)
            if "torch" in config
            else fo.Optimizer(params, fo.adamw(1e-4))
        )

        def step() -> None:
            model(x).square().mean().backward()
            if clip:
                nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()

    for _ in range(WARMUP):  # optimizer state, DDP's bucket rebuild
        step()
    _reset_peak()  # the peak of the steady steps, above the resident memory before training
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return _peak_mb() - base, statistics.median(times)


def _run(config: str, dim: int, layers: int, out: Any) -> None:
    """Child process: put :func:`_train`'s result on ``out``."""
    out.put(_train(config, dim, layers, ddp=False))


def _run_ddp(rank: int, config: str, dim: int, layers: int) -> tuple[float, float]:
    """One rank of a 2-rank gloo DDP world."""
    del rank
    return _train(config, dim, layers, ddp=True)


def _measure(config: str, dim: int, layers: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run, args=(config, dim, layers, out))
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
    args = benchmark_parser(__doc__, "~4M params, 1 round").parse_args(argv)
    dim, layers, rounds = (1024, 4, 1) if args.quick else (2048, 12, 3)
    params = layers * (dim * dim + dim)
    title = (
        f"### Optimizer in backward: MLP {layers} x Linear({dim}, {dim}), "
        f"{params / 1e6:.1f}M float32 params ({4 * params / 2**20:.0f} MB), batch {BATCH}, "
        f"1 thread, each configuration in a fresh process, median of {rounds} interleaved "
        "round(s)"
    )
    if not os.path.exists("/proc/self/statm"):
        return "\n".join([title, "", "skipped: needs Linux's /proc/self/statm"])
    results: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS}
    for r in range(rounds):
        shift = r % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            results[config].append(_measure(config, dim, layers))
    peak = {c: statistics.median(m for m, _ in v) for c, v in results.items()}
    secs = {c: statistics.median(s for _, s in v) for c, v in results.items()}
    ref = CONFIGS[0]
    rows = [
        [
            c,
            f"{peak[c]:.0f}",
            f"{peak[c] / peak[ref]:.2f}",
            f"{peak[c] / peak[SAME[c]]:.2f}" if c in SAME else "",
            f"{1e3 * secs[c]:.0f}",
            f"{secs[c] / secs[ref]:.2f}",
            f"{secs[c] / secs[SAME[c]]:.2f}" if c in SAME else "",
        ]
        for c in CONFIGS
    ]
    ddp = {c: spawn(_run_ddp, c, dim, layers, timeout_s=300) for c in DDP_CONFIGS}
    ddp_peak = {c: max(m for m, _ in v) for c, v in ddp.items()}
    ddp_secs = {c: max(s for _, s in v) for c, v in ddp.items()}
    ref = DDP_CONFIGS[0]
    ddp_rows = [
        [
            c,
            f"{ddp_peak[c]:.0f}",
            f"{ddp_peak[c] / ddp_peak[ref]:.2f}",
            f"{1e3 * ddp_secs[c]:.0f}",
            f"{ddp_secs[c] / ddp_secs[ref]:.2f}",
        ]
        for c in DDP_CONFIGS
    ]
    ddp_title = (
        "DDP, 2 gloo ranks, the same model (1 round; the larger peak and step time of the "
        "two ranks; ratios against DDP step after backward; DDP's buckets are counted):"
    )
    ddp_table = table(
        ("configuration", "peak MB", "x step after", "step ms", "x step after"), ddp_rows, "lrrrr"
    )
    return "\n".join([title, "", *table(HEADERS, rows, "lrrrrrr"), "", ddp_title, "", *ddp_table])


if __name__ == "__main__":
    print(main())
