"""One training run of ``lm_diloco.py`` on every rank, and the loop over seeds and methods.

``world`` is what ``lm_diloco.py`` spawns on each rank of a gloo group: every seed and method in
turn, each from the seed's initial weights and batches, counting the bytes each method hands to
collectives (``_lm_methods.CollectiveCounter``). Private to the benchmarks (``_``-prefixed).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from _charlm import (
    CharTransformer,
    ShardSampler,
    held_out_loss,
    held_out_windows,
    load_corpus,
    lr_factor,
    next_byte_loss,
)
from _lm_methods import CollectiveCounter, make_method

Config = Any  # lm_diloco.Config (not imported: lm_diloco imports this module)


def _over_ranks(value: float, op: str) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(tensor) / (1 if op == "max" else dist.get_world_size())


def _train(
    rank: int, world_size: int, name: str, config: Config, options: dict[str, Any] | None
) -> dict[str, Any]:
    """Train one method; return its curve and totals (the same on every rank)."""
    import torch.distributed as dist

    corpus = load_corpus(config.corpus_bytes)
    windows = held_out_windows(corpus.held_out, config.context, config.eval_windows)
    sampler = ShardSampler(
        corpus.train, rank, world_size, config.context, config.batch, config.seed
    )
    torch.manual_seed(config.seed)
    model = CharTransformer(config.context, config.width, config.layers, config.heads)
    params = list(model.parameters())
    counter = CollectiveCounter()
    counter.install()
    points: list[dict[str, float]] = []
    peak = 0
    first_payload, first_wire = 0, 0.0
    train_seconds = 0.0

    def record(step: int) -> None:
        counter.counting = False  # the evaluation's own all-reduces are not the method's
        points.append(
            {
                "step": step,
                "loss": _over_ranks(held_out_loss(model, windows), "mean"),
                "bytes": float(counter.payload),
                "wire": counter.wire,
                "seconds": _over_ranks(train_seconds, "max"),
            }
        )
        counter.counting = True

    def count(tensor: torch.Tensor) -> None:  # torchft's all-reduces (not torch.distributed's)
        counter.add(tensor, allreduce=True)

    try:
        method = make_method(name, model, config, options, count)
        inner = method.make_inner(params, config)
        optimizer = method.wrap(inner)
        schedule = torch.optim.lr_scheduler.LambdaLR(inner, lr_factor(config))
        dist.barrier()
        record(0)
        for step in range(1, config.steps + 1):
            start = time.perf_counter()
            before = counter.payload
            optimizer.zero_grad(set_to_none=True)
            next_byte_loss(method.module, sampler()).backward()
            method.before_step(params)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            method.after_step(params)
            if step == config.steps:
                method.finish(params)
            if step == 1:  # step 1 holds the averagers' initial full average
                first_payload, first_wire = counter.payload, counter.wire
            else:
                peak = max(peak, counter.payload - before)
            train_seconds += time.perf_counter() - start
            if (step - 1) % config.period == 0:  # right after the averagers' syncs
                record(step)
        own = method.own_count()
    finally:
        counter.uninstall()
    return {
        "points": points,
        "loss": points[-1]["loss"],
        "bytes": counter.payload,
        "wire": counter.wire,
        "steady_bytes": counter.payload - first_payload,  # after step 1
        "steady_wire": counter.wire - first_wire,
        "own_count": own,
        "peak": peak,
        "seconds": points[-1]["seconds"],
        "params": sum(p.numel() for p in params),
        "corpus": f"{len(corpus.train):,} train / {len(corpus.held_out):,} held-out bytes, "
        f"{corpus.files} files ({corpus.held_out_files} held out), sha256 {corpus.sha256}",
    }


def _log(rank: int, log: str | None, entry: dict[str, Any]) -> None:
    """Rank 0 appends one JSON line per finished run to ``log`` (results survive an abort)."""
    if rank == 0 and log:
        import json

        with open(log, "a", encoding="utf-8") as out:
            out.write(json.dumps({k: v for k, v in entry.items() if k != "points"}) + "\n")


def world(
    rank: int,
    world_size: int,
    names: list[str],
    config: Config,
    seeds: list[int],
    methods: dict[str, dict[str, Any] | None],
    log: str | None = None,
) -> dict[int, dict[str, Any]]:
    """Every seed and method in turn in one process group; one that cannot start is skipped.

    Returns:
        seed -> method -> result.
    """
    out: dict[int, dict[str, Any]] = {}
    for seed in seeds:
        results: dict[str, Any] = {}
        for name in names:
            try:
                seeded = replace(config, seed=seed)
                results[name] = _train(rank, world_size, name, seeded, methods[name])
            except ImportError as error:  # the same on every rank: no rank waits on another
                first = str(error).split(" (")[0]
                results[name] = {"skipped": f"{type(error).__name__}: {first}"}
            except Exception as error:  # torchft's start-up or sync: reported, not fatal
                if name != "torchft DiLoCo":
                    raise
                message = " ".join(str(error).split())[:300]
                results[name] = {"skipped": f"{type(error).__name__}: {message}"}
            _log(
                rank,
                log,
                {"world": world_size, "seed": seed, "method": name, **results[name]},
            )
        out[seed] = results
    return out
