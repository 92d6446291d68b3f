"""Benchmark: ``fo.muon`` step on FSDP2 (DTensor ``Shard(0)``) matrices, owner-rank Newton-Schulz.

Two gloo ranks on 127.0.0.1 (spawned with a timeout). Each rank builds the weight matrices of
a small transformer (per layer: q, k, v, o ``d x d``, MLP up ``4d x d`` and down ``d x 4d``)
as FSDP2 params, gives them fixed DTensor gradients and times the optimizer step alone,
median of interleaved rounds (one step of each contender per round, rotating order), the
slower rank's median reported:

- ``fo.Optimizer(params, fo.muon(...))``: momentum on the local shards, each matrix sent (as
  bfloat16) to one owner rank in one ``all_to_all``, orthogonalised there once, the result
  sent back in a second ``all_to_all``;
- naive: momentum on the local shards, then every rank all-gathers every matrix
  (``full_tensor()``, the update's dtype) and orthogonalises all of them;
- torch AdamW ``fused=True`` on the same DTensor params (no communication; what Muon costs
  over AdamW).

Bytes: sent per step, summed over ranks (the optimizer's collectives only). The last column
checks that ours and the naive step leave bitwise equal params after the same steps.

Usage: ``python benchmarks/sharded_muon.py [--quick]``; ``main(argv) -> str`` returns the
markdown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from _harness import benchmark_parser, emit, interleaved_median_ms, spawn, table

WORLD = 2
MODELS = (("d=128, 2 layers", 128, 2), ("d=128, 4 layers", 128, 4), ("d=192, 2 layers", 192, 2))
CONTENDERS = ("fo.muon (owner NS)", "naive (all-gather, NS everywhere)", "torch AdamW fused")
MUON: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}


def _shapes(d: int, layers: int) -> list[tuple[int, int]]:
    return [(d, d)] * 4 * layers + [(4 * d, d), (d, 4 * d)] * layers


class _Mats(torch.nn.Module):
    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mats = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s) / s[1] ** 0.5) for s in shapes
        )


def _fsdp_params(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_Mats(shapes))
    gen = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    for p in params:  # the same fixed gradient for every contender (the full tensor's rows)
        full = torch.randn(p.shape, generator=gen) * 1e-2
        p.grad = torch.zeros_like(p)
        rows = p._local_tensor.shape[0]  # type: ignore[attr-defined]
        start = _row_start(p)
        p.grad._local_tensor.copy_(full[start : start + rows])  # type: ignore[union-attr]
    return params


def _row_start(p: Any) -> int:
    import torch.distributed as dist

    chunk = -(-p.shape[0] // dist.get_world_size())
    return min(p.shape[0], dist.get_rank() * chunk)


class _NaiveMuon:
    """Every rank all-gathers every matrix and orthogonalises all of them."""

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.bufs = [torch.zeros_like(p._local_tensor) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        from torch.distributed.tensor import DTensor

        from functional_optim.kernels.muon import adjusted_lr_ratio, newton_schulz

        lr, wd, momentum = MUON["lr"], MUON["weight_decay"], MUON["momentum"]
        for p, buf in zip(self.params, self.bufs, strict=True):
            local, grad = p._local_tensor, p.grad._local_tensor
            buf.lerp_(grad, 1 - momentum)
            direction = grad.lerp(buf, momentum)
            full = DTensor.from_local(
                direction, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
            ortho = newton_schulz(full, (3.4445, -4.775, 2.0315), 5, 1e-7)
            start = _row_start(p)
            local.mul_(1 - lr * wd)
            ratio = adjusted_lr_ratio(None, p.shape[0], p.shape[1])
            local.add_(ortho[start : start + local.shape[0]], alpha=-(lr * ratio))


def _bytes(shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """Bytes sent per step over all ranks: ours (bfloat16 there and back), the naive gather."""
    from functional_optim._sharded_matrix import assign_owners, row_counts

    owners = assign_owners(shapes, WORLD)
    ours = naive = 0
    for (m, n), owner in zip(shapes, owners, strict=True):
        counts = row_counts(m, WORLD)
        ours += 2 * 2 * (m - counts[owner]) * n  # to the owner and back, 2 bytes each
        naive += sum(c * n * 4 * (WORLD - 1) for c in counts)  # each shard to every other rank
    return ours, naive


def _measure(rank: int, rounds: int) -> list[tuple[dict[str, float], float]]:
    import functional_optim as fo

    del rank
    torch.set_num_threads(1)
    out = []
    for _, d, layers in MODELS:
        shapes = _shapes(d, layers)
        ours, naive, adamw = (_fsdp_params(shapes) for _ in range(3))
        steps: dict[str, Callable[[], Any]] = {
            CONTENDERS[0]: fo.Optimizer(ours, fo.muon(**MUON)).step,
            CONTENDERS[1]: _NaiveMuon(naive).step,
            CONTENDERS[2]: torch.optim.AdamW(adamw, lr=1e-3, fused=True).step,
        }
        times = interleaved_median_ms(steps, warmup=2, repeats=rounds)
        diff = max(
            float((a._local_tensor - b._local_tensor).abs().max())  # type: ignore[attr-defined]
            for a, b in zip(ours, naive, strict=True)
        )
        out.append((times, diff))
    return out


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; return the markdown report."""
    parser = benchmark_parser(__doc__, "3 rounds (< 60 s)")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else 11
    per_rank = spawn(_measure, rounds, timeout_s=900.0, world_size=WORLD)
    rows = []
    for m, (label, d, layers) in enumerate(MODELS):
        slowest = {name: max(rank[m][0][name] for rank in per_rank) for name in CONTENDERS}
        diff = max(rank[m][1] for rank in per_rank)
        ours_b, naive_b = _bytes(_shapes(d, layers))
        ours, naive, adamw = (slowest[name] for name in CONTENDERS)
        rows.append(
            [
                label,
                6 * layers,
                f"{ours:.1f}",
                f"{naive:.1f}",
                f"{adamw:.2f}",
                f"{naive / ours:.2f}x",
                f"{ours / adamw:.1f}x",
                f"{ours_b / 1e6:.2f}",
                f"{naive_b / 1e6:.2f}",
                f"{diff:g}",
            ]
        )
    headers = [
        "matrices",
        "count",
        "fo.muon ms",
        "naive ms",
        "AdamW fused ms",
        "naive / ours",
        "ours / AdamW",
        "ours MB sent",
        "naive MB sent",
        "max abs(ours - naive)",
    ]
    return emit(
        [
            f"## Muon step on FSDP2 matrices, {WORLD} gloo ranks (median of {rounds} "
            "interleaved rounds, slower rank; 1 thread per rank)",
            "",
            *table(headers, rows, "l" + "r" * (len(headers) - 1)),
        ]
    )


if __name__ == "__main__":
    main()
