"""Benchmark: FSDP2 + ``fo.adamw`` against DDP + ``torch.optim.AdamW`` on a byte-level LM.

``_charlm.py``'s transformer (``lm_diloco.py``'s workload: the stdlib's ``.py`` sources) trains
on 2 gloo ranks (CPU) from the same initial weights on the same per-rank batches (one batch per
step, fed to every method), with the same AdamW hyperparameters, clipping (total norm 1.0) and
``LambdaLR`` schedule (``lm_diloco.py``'s: linear warm-up, cosine decay to lr / 10), as:

- (a) **DDP + torch AdamW**: ``DistributedDataParallel`` and ``torch.optim.AdamW``;
- (b) **FSDP2 + fo.adamw**: ``fully_shard`` on each transformer block and on the root
  (``DTensor`` shards, gradients reduce-scattered), ``fo.Optimizer(params, fo.adamw(...))``;
- (c) **FSDP2 + torch AdamW**: separates FSDP2's own rounding (vs DDP) from ours;
- (d) on request (``--methods abcd``; the test runs it): Adam with L2 decay in place of AdamW's
  decoupled decay, a wrong optimizer the (a)-(b) bounds must reject.

All use fused AdamW where torch runs it on CPU (torch >= 2.4; else torch's default path): (b)
and (c) run one kernel on the same shards, bitwise; (a) and (b) sum in another order, equal to
float rounding amplified by training (``TOLERANCE``). The methods take turns in every step
(rotating order); step time: median over steps of the slowest rank's zero_grad to schedule step.

Usage: ``python benchmarks/lm_fsdp2.py [--quick] [--steps N] [--every N] [--methods abc]``;
``main(argv)`` returns the markdown (raises if a check fails); :func:`compare` the figures.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

import _charlm as charlm
from _harness import benchmark_parser, emit, spawn, table

WORLD_SIZE = 2
DDP_TORCH = "DDP + torch AdamW"
FSDP2_FO = "FSDP2 + fo.adamw"
FSDP2_TORCH = "FSDP2 + torch AdamW"
METHODS = (DDP_TORCH, FSDP2_FO, FSDP2_TORCH)
WRONG = "FSDP2 + fo.adam with L2 decay (control)"
LETTERS = dict(zip((*METHODS, WRONG), "abcd"))
# (a)-(b) bounds on |loss difference| / loss, float32 rounding amplified by training (TOLERANCE)
EARLY_STEPS = 10
EARLY_RELATIVE = 1e-6
RUN_RELATIVE = 1e-5


@dataclass(frozen=True)
class Config:
    """Everything that sizes a run (the defaults: the full run); the same for every method."""

    steps: int = 500
    width: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 64
    batch: int = 16  # windows per rank per step
    lr: float = 3e-3  # peak AdamW learning rate
    warmup: int = 30  # linear warm-up steps, then cosine decay to lr / 10
    eval_windows: int = 256
    corpus_bytes: int = 1_500_000
    every: int = 50  # the curve table shows every ``every``-th step
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    eps: float = 1e-8
    clip: float = 1.0
    seed: int = 0


FULL = Config()
QUICK = Config(steps=60, width=32, context=32, batch=8, warmup=10, eval_windows=64, every=10)


def fused_adamw_runs_on_cpu() -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` steps a CPU tensor (torch >= 2.4)."""
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    try:
        torch.optim.AdamW([param], fused=True).step()
    except RuntimeError:
        return False
    return True


@dataclass
class _Run:
    """One method on one rank."""

    module: nn.Module  # what the step calls (DDP's wrapper, or the FSDP2-sharded model)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR


def _build(name: str, config: Config, fused: bool) -> _Run:
    """The model from ``config.seed`` set up for method ``name``."""
    import functional_optim as fo

    torch.manual_seed(config.seed)
    model = charlm.CharTransformer(config.context, config.width, config.layers, config.heads)
    module: nn.Module = model
    if name == DDP_TORCH:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    hyper: dict[str, Any] = {"lr": config.lr, "betas": config.betas, "eps": config.eps}
    hyper |= {"weight_decay": config.weight_decay, **({"fused": True} if fused else {})}
    optimizer: torch.optim.Optimizer
    if name == FSDP2_FO:
        optimizer = fo.Optimizer(model.parameters(), fo.adamw(**hyper))
    elif name == WRONG:
        optimizer = fo.Optimizer(model.parameters(), fo.adam(**hyper))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **hyper)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, charlm.lr_factor(config))
    return _Run(module, model, optimizer, schedule)


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for an FSDP2 shard)."""
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()


def _train(rank: int, names: list[str], config: Config, fused: bool) -> dict[str, Any]:
    """Every method in lock step on this rank; per-step losses and times, final figures."""
    corpus = charlm.load_corpus(config.corpus_bytes)
    windows = charlm.held_out_windows(corpus.held_out, config.context, config.eval_windows)
    sampler = charlm.ShardSampler(
        corpus.train, rank, WORLD_SIZE, config.context, config.batch, config.seed
    )
    runs = {name: _build(name, config, fused) for name in names}
    seen = {k: {n: list[float]() for n in names} for k in ("losses", "step_s", "optimizer_s")}
    for step in range(config.steps):
        batch = sampler()
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            start = time.perf_counter()
            run.optimizer.zero_grad(set_to_none=True)
            loss = charlm.next_byte_loss(run.module, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(run.model.parameters()), config.clip)
            before_step = time.perf_counter()
            run.optimizer.step()
            stepped = time.perf_counter()
            run.schedule.step()
            seen["step_s"][name].append(time.perf_counter() - start)
            seen["optimizer_s"][name].append(stepped - before_step)
            seen["losses"][name].append(float(loss.detach()))
    weights = {n: {k: _full(p) for k, p in r.model.named_parameters()} for n, r in runs.items()}
    keys = list(weights[names[0]])
    return {
        **seen,
        "held_out": {name: charlm.held_out_loss(run.model, windows) for name, run in runs.items()},
        "weights": {  # two methods' final weights: (max |difference|, where, bitwise equal)
            (x, y): (
                *max((float((weights[x][k] - weights[y][k]).abs().max()), k) for k in keys),
                all(torch.equal(weights[x][k], weights[y][k]) for k in keys),
            )
            for i, x in enumerate(names)
            for y in names[i + 1 :]
        },
        "params": sum(p.numel() for p in weights[names[0]].values()),
        "corpus": f"{len(corpus.train):,} train / {len(corpus.held_out):,} held-out bytes, "
        f"sha256 {corpus.sha256}",
    }


# -- the comparison and its checks ----------------------------------------------------------------


def compare(
    config: Config, names: tuple[str, ...] = METHODS, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Train ``names`` on 2 gloo ranks in lock step; return the curves and figures.

    Args:
        config: the sizes (``QUICK``, ``FULL`` or a variant).
        names: distinct names from :data:`METHODS` and :data:`WRONG`.
        timeout_s: wall-clock limit of the whole run (every process is killed after it).

    Returns:
        ``{"config", "fused", "params", "corpus", "methods": {name: {"curve" (training loss per
        step, mean over ranks), "held_out", "step_ms", "optimizer_ms"}}, "weights": {(name,
        name): (max |difference| of the final weights, parameter, bitwise equal)}}``.

    Raises:
        ValueError: an unknown or repeated method name (before any process starts).
        TimeoutError: the ranks did not finish within ``timeout_s``.
        RuntimeError: a rank raised (its traceback in the message) or died.
    """
    if not names or len(set(names)) != len(names) or not set(names) <= set(LETTERS):
        raise ValueError(f"methods: distinct names from {list(LETTERS)}, got {names}")
    fused = fused_adamw_runs_on_cpu()
    ranks = spawn(_train, list(names), config, fused, timeout_s=timeout_s, world_size=WORLD_SIZE)

    def slowest_median_ms(key: str, name: str) -> float:
        per_step: list[float] = [max(t) for t in zip(*(rank[key][name] for rank in ranks))]
        return 1e3 * statistics.median(per_step)

    methods = {
        name: {
            "curve": [statistics.fmean(v) for v in zip(*(r["losses"][name] for r in ranks))],
            "held_out": ranks[0]["held_out"][name],
            "step_ms": slowest_median_ms("step_s", name),
            "optimizer_ms": slowest_median_ms("optimizer_s", name),
        }
        for name in names
    }
    shared = {key: ranks[0][key] for key in ("params", "corpus", "weights")}
    return {"config": config, "fused": fused, "methods": methods, **shared}


def curve_gap(a: list[float], b: list[float], upto: int | None = None) -> tuple[float, float]:
    """Max |a - b| over the first ``upto`` steps (all if None), absolute and relative to |a|."""
    pairs = list(zip(a, b))[:upto]
    return max(abs(x - y) for x, y in pairs), max(abs(x - y) / abs(x) for x, y in pairs)


def rounding_gaps(result: dict[str, Any], name: str) -> dict[str, float]:
    """How far method ``name``'s losses are from (a)'s.

    Returns:
        ``first``: |difference| of the step-1 loss (0 unless broken); relative to (a)'s loss:
        ``early``, the largest over the first ``EARLY_STEPS`` steps; ``run``, over all steps;
        ``held_out``, of the final held-out loss.
    """
    a, b = result["methods"][DDP_TORCH], result["methods"][name]
    return {
        "first": abs(b["curve"][0] - a["curve"][0]),
        "early": curve_gap(a["curve"], b["curve"], EARLY_STEPS)[1],
        "run": curve_gap(a["curve"], b["curve"])[1],
        "held_out": abs(b["held_out"] / a["held_out"] - 1),
    }


def within_rounding(gaps: dict[str, float]) -> bool:
    """Whether :func:`rounding_gaps` are within the float32 rounding bounds of this module."""
    late = max(gaps["run"], gaps["held_out"])
    return gaps["first"] == 0 and gaps["early"] <= EARLY_RELATIVE and late <= RUN_RELATIVE


def verdicts(result: dict[str, Any]) -> list[str]:
    """The checks of the report, one line each, starting with ``PASS`` or ``FAIL``."""
    methods, lines = result["methods"], []
    if DDP_TORCH in methods and FSDP2_FO in methods:
        gaps = rounding_gaps(result, FSDP2_FO)
        ok = within_rounding(gaps)
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: (b) vs (a): {'equal' if ok else 'NOT equal'} within "
            f"float rounding: step-1 loss gap {gaps['first']:.1e} (must be 0); relative gap of "
            f"the training loss {gaps['early']:.1e} over the first {EARLY_STEPS} steps (bound "
            f"{EARLY_RELATIVE:.0e}), {gaps['run']:.1e} over the run and {gaps['held_out']:.1e} "
            f"in held-out loss (bound {RUN_RELATIVE:.0e})"
        )
    if FSDP2_FO in methods and FSDP2_TORCH in methods:
        b, c = methods[FSDP2_FO], methods[FSDP2_TORCH]
        same = b["curve"] == c["curve"] and b["held_out"] == c["held_out"]
        difference, where, bitwise = result["weights"][(FSDP2_FO, FSDP2_TORCH)]
        lines.append(
            f"{'PASS' if same and bitwise else 'FAIL'}: (b) vs (c): training loss curve and "
            f"held-out loss {'bitwise equal' if same else 'DIFFER'}; final weights "
            + ("bitwise equal" if bitwise else f"differ by up to {difference:.1e} in {where}")
        )
    return lines


TOLERANCE = (
    "Tolerance: step 1 is the same forward on the same weights: its loss must be equal. After "
    "it (a) and (b) differ by the order of float32 sums (all-reduce vs reduce-scatter of the "
    "gradients; clipping's norm over whole gradients vs over shards), about 1 ulp (6e-8 "
    "relative) per step, which training amplifies: measured 5e-8 relative over the first 10 "
    "steps, 1e-7 over --quick's 60, 1.4e-6 over 1000. Bounds: {early:.0e} over the first "
    "{steps} steps, {run:.0e} over the run and the held-out loss (7x the 1000-step drift). "
    "Subtly wrong AdamWs fail them (--quick: eps 1e-7, weight decay 1% high or beta2 0.951 move "
    "the loss by 2e-6 to 2e-5 in 10 steps, 3e-5 to 9e-5 over the run; (d): 2e-2). Final weights "
    "differ by about 1e-6, but by about lr where the true gradient is zero (qkv.bias's key "
    "part: softmax ignores a shift shared by all keys): that gradient is rounding noise, which "
    "Adam scales to lr-sized steps; the loss cannot see it."
)


def report(result: dict[str, Any]) -> list[str]:
    """The markdown lines of ``result`` (from :func:`compare`); the first method is the
    reference of the gap and ratio columns."""
    config, methods = result["config"], result["methods"]
    names = list(methods)
    ref, ref_letter = methods[names[0]], f"({LETTERS[names[0]]})"
    rows = []
    for name, got in methods.items():
        gap, relative = curve_gap(ref["curve"], got["curve"])
        held_gap = abs(got["held_out"] - ref["held_out"])
        row = [f"({LETTERS[name]}) {name}", f"{got['curve'][-1]:.6f}", f"{got['held_out']:.7f}"]
        row += (
            [f"{gap:.2e} ({relative:.1e} rel.)", f"{held_gap:.2e}"]
            if name != names[0]
            else ["", ""]
        )
        row += [f"{got['step_ms']:.1f}", f"{got['step_ms'] / ref['step_ms']:.2f}x"]
        row += [f"{got['optimizer_ms']:.2f}", f"{got['optimizer_ms'] / ref['optimizer_ms']:.2f}x"]
        rows.append(row)
    pairs = [
        f"({LETTERS[x]}) vs ({LETTERS[y]}): "
        + ("bitwise equal" if same else f"{difference:.2e} (in {where})")
        for (x, y), (difference, where, same) in result["weights"].items()
    ]
    shown = sorted({*range(0, config.steps, config.every), config.steps - 1})
    curves = [methods[name]["curve"] for name in names]
    curve_rows = [
        [str(step + 1), *(f"{c[step]:.6f}" for c in curves)]
        + [f"{c[step] - curves[0][step]:+.1e}" for c in curves[1:]]
        for step in shown
    ]
    flag = "fused=True" if result["fused"] else "torch's default path (no fused AdamW on CPU)"
    sizes = ", ".join(f"{k}={v}" for k, v in asdict(config).items())
    headers = ["method", "last training loss", "held-out loss", f"loss gap vs {ref_letter}"]
    headers += ["held-out gap", "step ms", f"/ {ref_letter}", "optimizer ms", f"/ {ref_letter}"]
    curve_headers = ["step", *(f"({LETTERS[n]})" for n in names)]
    curve_headers += [f"({LETTERS[n]}) - {ref_letter}" for n in names[1:]]
    return [
        f"### FSDP2 + fo.adamw vs DDP + torch AdamW: byte-level LM, {config.steps} steps, "
        f"{WORLD_SIZE} gloo ranks (CPU)",
        "",
        f"Model: {result['params']:,} parameters; corpus: {result['corpus']}. Config: {sizes}. "
        f"Every optimizer: AdamW, {flag}; LambdaLR warm-up + cosine; clip_grad_norm_ "
        f"{config.clip:g}. Same initial weights and per-rank batches. Training loss: mean over "
        "ranks. Step: median over steps of the slowest rank (zero_grad to schedule step), the "
        "methods interleaved in every step; optimizer: its `step()` alone.",
        "",
        *table(headers, rows, "lrrrrrrrr"),
        "",
        f"Final weights, max abs difference: {'; '.join(pairs) or 'one method'}.",
        "",
        f"Training loss every {config.every} steps:",
        "",
        *table(curve_headers, curve_rows, "r" * (2 * len(names))),
        "",
        TOLERANCE.format(early=EARLY_RELATIVE, steps=EARLY_STEPS, run=RUN_RELATIVE),
        "",
        *(f"- {line}" for line in verdicts(result)),
    ]


def run_main(
    argv: list[str] | None,
    module: Any,
    quick: tuple[str, int],
    methods: tuple[str, str],
) -> str:
    """The command line of an LM benchmark ``module`` (its ``__doc__``, ``FULL``, ``QUICK``,
    ``LETTERS``, ``compare``, ``report``, ``verdicts``): parse, run, print and return the
    markdown.

    Args:
        argv: the arguments.
        module: the benchmark module.
        quick: ``--quick``'s help and its steps.
        methods: ``--methods``' default and what its control letters are.

    Raises:
        RuntimeError: a check failed (after the report is printed).
    """
    parser = benchmark_parser(module.__doc__, quick_help=quick[0])
    parser.add_argument(
        "--steps", type=int, help=f"training steps [{module.FULL.steps}; --quick {quick[1]}]"
    )
    parser.add_argument("--every", type=int, help="curve table: every N steps [config's]")
    parser.add_argument("--methods", default=methods[0], help=f"letters; {methods[1]}")
    args = parser.parse_args(argv)
    config = module.QUICK if args.quick else module.FULL
    for option in ("steps", "every"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option} must be positive, got {value}")
        config = replace(config, **{option: value}) if value is not None else config
    by_letter = {letter: name for name, letter in module.LETTERS.items()}
    names = tuple(by_letter.get(letter, letter) for letter in args.methods)
    try:
        result = module.compare(config, names, timeout_s=600 if args.quick else 1800)
    except ValueError as error:
        parser.error(str(error))
    markdown: str = emit(module.report(result))
    failed = [line for line in module.verdicts(result) if line.startswith("FAIL")]
    if failed:
        raise RuntimeError("; ".join(failed))
    return markdown


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return its markdown (raises if a check fails)."""
    import lm_fsdp2 as module  # this file under its own name (also when run as a script)

    return run_main(argv, module, ("smoke-test sizes (about a minute)", 60),
                    ("abc", "d: the wrong control [abc]"))  # fmt: skip


if __name__ == "__main__":
    main()
