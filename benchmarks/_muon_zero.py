"""The DDP section of ``sharded_muon.py``: whole-matrix Muon owners under data parallelism.

After DDP's gradient all-reduce every rank holds every gradient; a Muon step then only needs
each matrix orthogonalised once, on one rank, and the updated matrices sent to the others.
Two ways to pick the owners, on the same replicated params and gradients:

- ``compat_api.ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Muon,
  partition=...)``: ``"cost_balanced"`` (Newton-Schulz cost ``m * n * min(m, n)`` balanced over
  whole matrices) and torch's ``"sorted_greedy"`` (element counts), synced by packed broadcasts;
- KellerJordan-style round-robin (:class:`RoundRobinMuon`): the matrices sorted by size, the
  ``i``-th owned by rank ``i % world``; each rank runs ``torch.optim.Muon`` on its own and one
  ``all_gather`` per run of ``world`` matrices brings the results to every rank (a short or
  mixed-size run is padded to its largest matrix).

Private to the benchmarks (``_``-prefixed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from _harness import interleaved_median_ms
from _muon_peers import SentBytes

ZERO_PARTITIONS = ("cost_balanced", "sorted_greedy")
ROUND_ROBIN = "round-robin (KellerJordan-style)"
CONTENDERS = (*(f"ZeRO partition={p!r}" for p in ZERO_PARTITIONS), ROUND_ROBIN)


def ns_cost(shape: Sequence[int]) -> float:
    """Multiply-adds of one Newton-Schulz iteration on an ``m x n`` matrix (up to a constant)."""
    m, n = shape[0], math.prod(shape[1:])
    return float(m * n * min(m, n))


class RoundRobinMuon:
    """Matrix ``i`` (sorted by size, largest first) owned by rank ``i % world``; all-gathered.

    Args:
        params: the replicated matrices (the same on every rank).
        muon: ``torch.optim.Muon``'s hyperparameters.
    """

    def __init__(self, params: list[torch.Tensor], muon: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
        self.params = params
        self.runs = [order[k : k + self.world] for k in range(0, len(order), self.world)]
        self.owner = {i: k % self.world for k, i in enumerate(order)}
        mine = [params[i] for i in order if self.owner[i] == self.rank]
        self.local = torch.optim.Muon(mine, **muon) if mine else None

    def owners(self) -> list[int]:
        """The owning rank of each param."""
        return [self.owner[i] for i in range(len(self.params))]

    @torch.no_grad()
    def step(self) -> None:
        """Update the own matrices, then one ``all_gather`` per run of ``world`` matrices."""
        import torch.distributed as dist

        if self.local is not None:
            self.local.step()
        pending = []
        for run in self.runs:
            tensors = [self.params[i] for i in run]
            if len(run) == self.world and len({t.shape for t in tensors}) == 1:
                mine = tensors[self.rank]  # equal shapes: gather straight into the params
                pending.append((dist.all_gather(tensors, mine, async_op=True), None, None))
                continue
            size = max(t.numel() for t in tensors)
            send = torch.zeros(size)
            if self.rank < len(run):
                send[: tensors[self.rank].numel()] = tensors[self.rank].reshape(-1)
            out = [torch.empty(size) for _ in range(self.world)]
            pending.append((dist.all_gather(out, send, async_op=True), out, tensors))
        for work, out, tensors in pending:
            work.wait()
            if out is not None and tensors is not None:
                for r, t in enumerate(tensors):
                    if r != self.rank:
                        t.copy_(out[r][: t.numel()].view_as(t))


def _replicated(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The same params and fixed gradients on every rank (what DDP's all-reduce leaves)."""
    gen = torch.Generator().manual_seed(0)
    params = [(torch.randn(s, generator=gen) / s[1] ** 0.5).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return params


def _imbalance(costs: list[float]) -> float:
    low = min(costs)
    return math.inf if low == 0 else max(costs) / low


def measure_ddp(shapes: list[tuple[int, int]], muon: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Time each contender's step on this rank (a collective: every rank calls it).

    Returns:
        ``{"ms": {name: ms}, "sent": {name: bytes}, "imbalance": {name: max/min NS cost},
        "diff": {name: max abs difference to the round-robin params}, "unknown": set}``.
    """
    from compat_api import ZeroRedundancyOptimizer

    params = {name: _replicated(shapes) for name in CONTENDERS}
    steps: dict[str, Callable[[], Any]] = {}
    owners: dict[str, list[int]] = {}
    for name, partition in zip(CONTENDERS, ZERO_PARTITIONS, strict=False):
        zero = ZeroRedundancyOptimizer(
            params[name], optimizer_class=torch.optim.Muon, partition=partition, **muon
        )
        steps[name] = zero.step
        owners[name] = [zero._param_to_rank[p] for p in params[name]]
    robin = RoundRobinMuon(params[ROUND_ROBIN], muon)
    steps[ROUND_ROBIN] = robin.step
    owners[ROUND_ROBIN] = robin.owners()

    world = torch.distributed.get_world_size()
    imbalance = {}
    for name, owned in owners.items():
        loads = [0.0] * world
        for shape, rank in zip(shapes, owned, strict=True):
            loads[rank] += ns_cost(shape)
        imbalance[name] = _imbalance(loads)
    sent, unknown = {}, set()
    for name, step in steps.items():
        step()  # warm-up
        with SentBytes() as counter:
            step()
        sent[name] = counter.sent
        unknown |= counter.unknown
    ms = interleaved_median_ms(steps, warmup=1, repeats=rounds)
    diff = {
        name: max(
            float((a - b).detach().abs().max())
            for a, b in zip(params[name], params[ROUND_ROBIN], strict=True)
        )
        for name in CONTENDERS
    }
    return {"ms": ms, "sent": sent, "imbalance": imbalance, "diff": diff, "unknown": unknown}
