"""Benchmark: DDP vs post-local SGD vs the DiLoCo family and torchft on a byte-level LM, by seed.

A small decoder-only transformer learns the Python standard library's own ``.py`` sources (no
download; see ``_charlm.py``) on 2 and 4 gloo processes. Every method runs the same number of
inner steps from the same initial weights on the same per-rank batches (one contiguous shard of
the training bytes per rank, windows drawn from a generator seeded by seed and rank), with the
same learning-rate schedule (linear warm-up, cosine decay), once per seed (``--seeds``; the
seed sets the initial weights and the batches):

- **DDP**: gradients all-reduced every step (DDP's default ``allreduce_hook``, one call per
  bucket); **DDP + Muon**: the same with MuLoCo's inner optimizer (what Muon alone gives).
- **post-local SGD**: ``compat_api``'s ``PostLocalSGDOptimizer`` around the AdamW with a
  ``PeriodicModelAverager``: parameters averaged every ``H`` steps (no DDP warm-up).
- **DiLoCo**: ``compat_api``'s ``DiLoCoAverager`` every ``H`` steps, outer Nesterov SGD with
  lr 1.0 and momentum 0.5 (Douillard et al. 2023 use lr 0.7, momentum 0.9, tuned for 8 replicas
  over many outer steps; with 2-4 ranks and 20-40 outer steps that momentum overshoots: the
  sweep in docs/benchmarks.md chose lr 1.0, momentum 0.5); **streaming**: ``P`` fragments on
  staggered schedules with the all-reduce overlapped; **int8**: the outer gradients sent as
  int8 (**int4**: 4-bit codes, two per byte); **warm start**: ``WarmStartDiLoCoAverager``,
  gradients averaged for the first ``--warm-start`` steps, then DiLoCo; **MuLoCo**:
  ``muloco()``, Muon (``fo.muon``) as the inner optimizer of the weight matrices (not the
  embeddings) and AdamW for the rest;
  **SparseLoCo**: ``SparseLoCoAverager``, top-k (``--density`` per 4,096-value chunk) plus
  ``--bits``-bit codes with error feedback, outer SGD lr ``--sparse-outer-lr``. The DiLoCo
  methods copy the starting model at construction (``params=...``): the ranks start from the
  same weights, so there is no initial average, and the first outer sync is one period after
  step 1 (the warm start's at the end of its data-parallel phase).
- **torchft DiLoCo**: torchft 0.2.0's ``torchft.local_sgd.DiLoCo`` with the same outer step and
  H (``_torchft_peer.py``; its lighthouse is started by rank 0); skipped with the error when
  torchft cannot be imported or started.

Bytes are counted the same way for every method: the size of each tensor this rank hands to
``dist.all_reduce`` / the all-gathers (wrapped for the run; DDP's hook and the averagers call
them) or to torchft's ``Manager.allreduce``, cross-checked against the averagers' own
``bytes_communicated``. Reported per method and world size, as mean +/- standard deviation over
the seeds and per seed: held-out loss (nats per byte, mean over ranks of each rank's model),
payload bytes per rank, modelled ring wire bytes, the largest payload of any one step, and
training wall time (slowest rank, held-out evaluations excluded). A PNG plots held-out loss
against bytes and wall time (first seed).

Usage: ``python benchmarks/lm_diloco.py [--quick] [--seeds 0,1,2] [--out FOLDER]``;
``main(argv) -> str`` returns the markdown (the PNG is written to ``--out``). ``--log FILE``
appends each finished run as a JSON line; ``--from-log A,B`` renders the report from such files
without training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from _harness import benchmark_parser, emit, spawn, table
from _lm_train import world

TAKES_OUT_FOLDER = True  # run_all.py passes ``--out <report folder>`` (this writes a PNG there)
CHART = "lm_diloco_loss.png"


@dataclass(frozen=True)
class Config:
    """Everything that sizes a run; identical for every method."""

    syncs: int  # outer syncs after the first one; inner steps = syncs * period + 1
    period: int  # H: steps between syncs (post-local SGD, DiLoCo)
    fragments: int  # P of streaming DiLoCo
    width: int
    layers: int
    heads: int
    context: int
    batch: int  # windows per rank per step
    lr: float  # peak inner AdamW learning rate
    warmup: int  # linear warm-up steps, then cosine decay to lr / 10
    eval_windows: int
    corpus_bytes: int
    outer_lr: float = 1.0  # DiLoCo's outer SGD (every DiLoCo method)
    outer_momentum: float = 0.5  # the paper's 0.9 overshoots here (docs/benchmarks.md, the sweep)
    nesterov: bool = True
    seed: int = 0
    warm_start: int = 50  # data-parallel steps before DiLoCo (the warm-start method)
    # SparseLoCo: fraction of each 4,096-value chunk sent, bits per sent value, outer SGD lr (no
    # momentum: the error feedback), error-feedback decay. lr 3 and decay 0.8 were the best of
    # a small sweep at --quick sizes with 20 syncs, seed 0 (docs/benchmarks.md; the paper's
    # lr 1, decay 0.95 ended 7 points higher there).
    density: float = 0.03
    bits: int = 2
    sparse_outer_lr: float = 3.0
    feedback_decay: float = 0.8

    @property
    def steps(self) -> int:
        """Inner steps per rank.

        Both averagers sync at their first call (after step 1) and every ``period`` calls after
        it, so ``syncs * period + 1`` steps end right after a sync.
        """
        return self.syncs * self.period + 1


FULL = Config(
    syncs=16,  # 3 seeds x 11 methods x 2 world sizes on 2 cores: 801 steps per run (was 2,001)
    period=50,
    fragments=2,
    width=64,
    layers=2,
    heads=4,
    context=64,
    batch=16,
    lr=3e-3,
    warmup=50,
    eval_windows=256,
    corpus_bytes=1_500_000,
)
QUICK = Config(
    syncs=4,
    period=20,
    fragments=2,
    width=32,
    layers=2,
    heads=4,
    context=32,
    batch=8,
    lr=3e-3,
    warmup=10,
    warm_start=20,
    eval_windows=64,
    corpus_bytes=400_000,
)

# name -> DiLoCoAverager keyword arguments (None: not a DiLoCo method).
METHODS: dict[str, dict[str, Any] | None] = {
    "DDP": None,
    "DDP + Muon": None,  # DDP with MuLoCo's inner optimizer (what Muon alone gives)
    "post-local SGD": None,
    "DiLoCo": {},
    "Streaming DiLoCo": {"overlap": True},  # + fragments=P
    "DiLoCo + int8": {"compression": "int8"},
    "DiLoCo + int4": {"compression": "int4"},
    "DiLoCo + warm start": {},  # WarmStartDiLoCoAverager(warm_start_steps=config.warm_start)
    "MuLoCo": {},  # muloco(): Muon + AdamW inner, DiLoCo outer
    "SparseLoCo": {},  # SparseLoCoAverager(density, bits, feedback_decay) from the config
    # The same at 25% density, 2 bits, the paper's lr 1 and decay 0.95: about 1/350 of DDP.
    "SparseLoCo 25%": {
        "density": 0.25,
        "bits": 2,
        "sparse_outer_lr": 1.0,
        "feedback_decay": 0.95,
    },
    "torchft DiLoCo": None,  # _torchft_peer.TorchftDiLoCo
}


# -- report ---------------------------------------------------------------------------------------


def _notes(config: Config) -> dict[str, str]:
    kind = "Nesterov" if config.nesterov and config.outer_momentum else "SGD"
    outer = f"outer {kind} lr {config.outer_lr:g} m {config.outer_momentum:g}"
    h = f"H={config.period}"
    return {
        "DDP": "gradients every step",
        "DDP + Muon": "gradients every step, Muon (matrices) + AdamW",
        "post-local SGD": h,
        "DiLoCo": f"{h}, {outer}",
        "Streaming DiLoCo": f"{h}, P={config.fragments}, overlapped",
        "DiLoCo + int8": f"{h}, int8 all-gather",
        "DiLoCo + int4": f"{h}, int4 all-gather (64-element blocks)",
        "DiLoCo + warm start": f"{h}, gradients averaged for {config.warm_start} steps first",
        "MuLoCo": f"{h}, Muon (matrices) + AdamW inner, {outer}",
        **{
            name: f"{h}, top-{c.density:g} per 4,096, {c.bits}-bit, "
            f"EF decay {c.feedback_decay:g}, outer SGD lr {c.sparse_outer_lr:g}"
            for name in ("SparseLoCo", "SparseLoCo 25%")
            for c in [replace(config, **(METHODS[name] or {}))]
        },
        "torchft DiLoCo": f"{h}, torchft 0.2.0, {outer}, per-parameter all-reduce",
    }


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print and return its markdown (and write the PNG to ``--out``)."""
    import _lm_diloco_report as report

    parser = benchmark_parser(__doc__, quick_help="smoke-test sizes (a few minutes)")
    parser.add_argument("--out", default="bench-out", help="folder for the PNG [bench-out]")
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated [2,4]")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated [0,1,2]")
    parser.add_argument("--methods", default=",".join(METHODS), help="subset, comma-separated")
    parser.add_argument("--log", help="append one JSON line per finished run to this file")
    parser.add_argument(
        "--from-log", help="render the report from --log files (comma-separated), no training"
    )
    for flag, kind, text in (
        ("--syncs", int, "outer syncs after step 1"),
        ("--period", int, "H, inner steps per sync"),
        ("--lr", float, "peak inner learning rate"),
        ("--outer-lr", float, "DiLoCo's outer SGD lr"),
        ("--outer-momentum", float, "outer SGD momentum"),
        ("--warm-start", int, "data-parallel steps of the warm-start method"),
        ("--density", float, "SparseLoCo's top-k density"),
        ("--bits", int, "SparseLoCo's bits per value"),
        ("--sparse-outer-lr", float, "SparseLoCo's outer SGD lr"),
        ("--feedback-decay", float, "SparseLoCo's error-feedback decay"),
    ):
        parser.add_argument(flag, type=kind, help=f"{text} [config's]")
    parser.add_argument(
        "--nesterov",
        type=int,
        choices=(0, 1),
        help="outer Nesterov momentum, 0/1 [config's]",
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    fields = (
        "syncs",
        "period",
        "lr",
        "outer_lr",
        "outer_momentum",
        "warm_start",
        "density",
    )
    overrides = {k: getattr(args, k) for k in (*fields, "bits", "sparse_outer_lr")}
    overrides["feedback_decay"] = args.feedback_decay
    overrides["nesterov"] = None if args.nesterov is None else bool(args.nesterov)
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    names = [name.strip() for name in args.methods.split(",")]
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    # Bad input before any process starts (the averagers check again).
    from compat_api.algorithms.model_averaging.warm_start import check_warm_start_steps
    from dist_runtime.sparse_codec import check_sparse_args

    try:
        check_sparse_args(config.density, config.bits, 4096, config.feedback_decay)
        check_warm_start_steps(config.warm_start)
    except ValueError as error:
        parser.error(str(error))
    seeds = [int(s) for s in args.seeds.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    results: report.Results = {}
    if args.from_log:
        results = report.load_logs(args.from_log.split(","), worlds, seeds, names)
    for world_size in [] if args.from_log else worlds:
        timeout = (600 if args.quick else 7200) * len(seeds)
        results[world_size] = spawn(
            world,
            world_size,
            names,
            config,
            seeds,
            METHODS,
            args.log,
            timeout_s=timeout,
            world_size=world_size,
        )[0]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.from_log:  # (the logs keep no curves)
        report.plot({w: results[w][seeds[0]] for w in worlds}, out / CHART)
    summaries = {w: report.summarise(results[w]) for w in worlds}
    notes = _notes(config)
    first = next((r for w in worlds for r in results[w][seeds[0]].values() if "params" in r), {})
    sizes = ", ".join(f"{k}={v}" for k, v in asdict(config).items() if k != "seed")
    return emit(
        [
            f"### Byte-level LM on the stdlib sources: {config.steps} inner steps per rank, "
            f"{'/'.join(map(str, worlds))} gloo ranks, seeds {', '.join(map(str, seeds))}",
            "",
            f"Model: {first.get('params', 0):,} parameters; corpus: {first.get('corpus', '?')}. "
            f"Config: {sizes}. Per seed the same initial weights, batches and schedule for "
            "every method. Loss: held-out nats/byte after the last step (mean over ranks); "
            "mean ± sample std over the seeds, vs DDP taken per seed. Payload: bytes of the "
            "tensors this rank hands to collectives (first seed; the same for every seed). "
            "Ring wire after step 1: modelled bytes a ring sends per rank (all-reduce "
            "2(n-1)/n x payload, all-gather (n-1) x payload). Wall: training seconds of the "
            "slowest rank, evaluations excluded, mean over seeds.",
            "",
            *table(
                report.MEAN_HEADERS,
                [row for w in worlds for row in report.mean_rows(w, summaries[w], notes)],
                "lrrrrrrrrl",
            ),
            "",
            *(line for w in worlds for line in report.targets(w, summaries[w], config.period)),
            "",
            "Per seed:",
            "",
            *table(
                report.SEED_HEADERS,
                [row for w in worlds for row in report.seed_rows(w, results[w])],
                "lrrrrrrr",
            ),
            "",
            f"![held-out loss vs bytes and vs wall time, seed {seeds[0]}]({CHART})",
        ]
    )


if __name__ == "__main__":
    main()
