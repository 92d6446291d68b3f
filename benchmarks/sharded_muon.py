"""Benchmark: Muon on FSDP2 (DTensor ``Shard(0)``) matrices and under DDP, side by side.

Gloo ranks on 127.0.0.1, 2 and then 4 (each world spawned on its own, 1 thread per rank). Each
rank builds the weight matrices of a small transformer (per layer: q, k, v, o ``d x d``, MLP up
``4d x d`` and down ``d x 4d``), gives them fixed gradients and times the optimizer step
alone: the median of interleaved rounds (one step of each contender per round, rotating
order), the slower rank's median reported.

FSDP2 section, every contender on its own copy of the same FSDP2 params and gradients:

- ``fo.Optimizer(params, fo.muon(...))``: momentum on the local shards, each matrix sent (as
  bfloat16) to one owner rank, orthogonalised there once, the rows of the result sent back;
- naive: momentum on the local shards, then every rank all-gathers every matrix
  (``full_tensor()``, the update's dtype) and orthogonalises all of them (the issue's target:
  ours / naive <= 0.70 at 2 ranks, <= 0.45 at 4);
- torch AdamW ``fused=True`` (no communication; what Muon costs over AdamW);
- the peers of ``_muon_peers.py`` (torchtitan's ``build_dist_muon``, muon-fsdp2), each with the
  same hyperparameters; one that is not installed or cannot run here gets its error in its row.

DDP section (``_muon_zero.py``): replicated params after the gradient all-reduce;
``ZeroRedundancyOptimizer(optimizer_class=torch.optim.Muon, partition="cost_balanced")`` (and
torch's ``"sorted_greedy"``) against KellerJordan-style round-robin owners, with the
Newton-Schulz cost max/min over the ranks.

Bytes: what the optimizer step's collectives send per step, measured (``SentBytes``) on one
step and summed over the ranks. Correctness: max abs difference of the params after the same
steps (ours and naive must be bitwise equal).

Usage: ``python benchmarks/sharded_muon.py [--quick] [--worlds 2 4]``; ``main(argv) -> str``
returns the markdown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from _harness import benchmark_parser, emit, interleaved_median_ms, spawn, table
from _muon_peers import MESH_AXIS, PEERS, SentBytes, build_peer, short_error
from _muon_zero import CONTENDERS as DDP_CONTENDERS
from _muon_zero import ROUND_ROBIN, measure_ddp

WORLDS = (2, 4)
#: issue 23: ours / naive step time at each world size
TARGETS = {2: 0.70, 4: 0.45}
OURS, NAIVE, ADAMW = "fo.muon (owner NS)", "naive (all-gather, NS everywhere)", "torch AdamW fused"
CONTENDERS = (OURS, NAIVE, ADAMW)
MUON: dict[str, Any] = {
    "lr": 0.02,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
}
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (fo.muon's too)
#: Megatron-FSDP's Muon step against its Adam step (the issue's reference)
MEGATRON_VS_ADAM = "1.5-2.7x"


Shapes = tuple[tuple[int, int], ...]


def gpt_shapes(d: int, layers: int) -> Shapes:
    """A GPT block's matrices in model order: per layer q, k, v, o ``d x d``, MLP up ``4d x d``
    and down ``d x 4d``."""
    return ((d, d), (d, d), (d, d), (d, d), (4 * d, d), (d, 4 * d)) * layers


def llama_shapes(d: int, layers: int, kv: int, hidden: int) -> Shapes:
    """A Llama block's: q, o ``d x d``, grouped-query k, v ``kv x d``, SwiGLU gate and up
    ``hidden x d``, down ``d x hidden`` (matrices of unlike ``min(m, n)``: NS cost is not
    proportional to size)."""
    return ((d, d), (kv, d), (kv, d), (d, d), (hidden, d), (hidden, d), (d, hidden)) * layers


MODELS: tuple[tuple[str, Shapes], ...] = (
    ("d=128, 2 layers", gpt_shapes(128, 2)),
    ("d=128, 4 layers", gpt_shapes(128, 4)),
    ("d=192, 2 layers", gpt_shapes(192, 2)),
    ("Llama d=192, 2 layers, k/v 48, SwiGLU 512", llama_shapes(192, 2, 48, 512)),
)


@dataclass(frozen=True)
class Size:
    """What one run measures: the models and the number of timed rounds."""

    models: tuple[tuple[str, Shapes], ...]
    rounds: int


FULL = Size(MODELS, 11)
QUICK = Size(MODELS[:1], 3)


class _Mats(torch.nn.Module):
    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mats = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(s) / s[1] ** 0.5) for s in shapes
        )


def _row_start(p: Any) -> int:
    chunk = -(-p.shape[0] // p.device_mesh.size())
    return min(p.shape[0], p.device_mesh.get_local_rank() * chunk)


def _fsdp_params(shapes: list[tuple[int, int]], mesh: Any) -> tuple[list[Any], list[str]]:
    """A fresh FSDP2 copy of the matrices with the same fixed gradients; (params, names)."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_Mats(shapes), mesh=mesh)
    gen = torch.Generator().manual_seed(1)
    named = list(model.named_parameters())
    for _, p in named:  # the same gradient for every contender (the full tensor's rows)
        full = torch.randn(p.shape, generator=gen) * 1e-2
        p.grad = torch.zeros_like(p)
        rows = p._local_tensor.shape[0]
        start = _row_start(p)
        p.grad._local_tensor.copy_(full[start : start + rows])
    return [p for _, p in named], [name for name, _ in named]


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
            ortho = newton_schulz(full, NS_COEFFICIENTS, MUON["ns_steps"], 1e-7)
            start = _row_start(p)
            local.mul_(1 - lr * wd)
            ratio = adjusted_lr_ratio(None, p.shape[0], p.shape[1])
            local.add_(ortho[start : start + local.shape[0]], alpha=-(lr * ratio))


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(
        float((x._local_tensor - y._local_tensor).abs().max()) for x, y in zip(a, b, strict=True)
    )


def _agree(failed: bool) -> bool:
    """True on every rank if any rank failed (so that all drop the same peer)."""
    import torch.distributed as dist

    flag = torch.tensor([1.0 if failed else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _fsdp(shapes: list[tuple[int, int]], mesh: Any, rounds: int) -> dict[str, Any]:
    """One model's FSDP2 section on this rank (a collective)."""
    import functional_optim as fo

    params: dict[str, list[Any]] = {}
    steps: dict[str, Callable[[], Any]] = {}
    errors: dict[str, str] = {}
    params[OURS], _ = _fsdp_params(shapes, mesh)
    steps[OURS] = fo.Optimizer(params[OURS], fo.muon(**MUON)).step
    params[NAIVE], _ = _fsdp_params(shapes, mesh)
    steps[NAIVE] = _NaiveMuon(params[NAIVE]).step
    params[ADAMW], _ = _fsdp_params(shapes, mesh)
    steps[ADAMW] = torch.optim.AdamW(params[ADAMW], lr=1e-3, fused=True).step
    for peer in PEERS:
        params[peer.label], names = _fsdp_params(shapes, mesh)
        try:
            steps[peer.label] = build_peer(peer, params[peer.label], names, MUON)
            steps[peer.label]()  # its warm-up step, where a peer that cannot run fails
        except Exception as exc:  # any failure of a peer is its row's result
            errors[peer.label] = short_error(exc)
            steps.pop(peer.label, None)
        if _agree(peer.label in errors):
            errors.setdefault(peer.label, "failed on another rank")
            steps.pop(peer.label, None)
    sent: dict[str, int] = {}
    unknown: set[str] = set()
    for name, step in steps.items():
        if name in CONTENDERS:
            step()  # warm-up (the peers had theirs)
        with SentBytes() as counter:
            step()
        sent[name], unknown = counter.sent, unknown | counter.unknown
    ms = interleaved_median_ms(steps, warmup=1, repeats=rounds)
    diff = {name: _max_diff(params[OURS], params[name]) for name in steps if name != ADAMW}
    return {"ms": ms, "sent": sent, "diff": diff, "errors": errors, "unknown": unknown}


def _measure(rank: int, size: Size) -> list[dict[str, Any]]:
    """Every model's FSDP2 and DDP sections on this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    del rank
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=(MESH_AXIS,))
    torch_muon = {**MUON, "ns_coefficients": NS_COEFFICIENTS}
    out = []
    for _, model in size.models:
        shapes = list(model)
        out.append(
            {
                "fsdp": _fsdp(shapes, mesh, size.rounds),
                "ddp": measure_ddp(shapes, torch_muon, size.rounds),
            }
        )
    return out


def run(size: Size, worlds: Sequence[int] = WORLDS, timeout_s: float = 600.0) -> dict[int, Any]:
    """Measure every model at each world size (one spawned gloo world after the other).

    Args:
        size: the models and rounds (:data:`FULL` or :data:`QUICK`).
        worlds: the numbers of ranks.
        timeout_s: wall-clock limit of each world.

    Returns:
        ``{world: [rank 0's results, rank 1's, ...]}`` (what :func:`report` reads).
    """
    return {w: spawn(_measure, size, timeout_s=timeout_s, world_size=w) for w in worlds}


# -- report ---------------------------------------------------------------------------------------


def _merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One section over the ranks: the slower rank's ms, bytes summed, the largest diff."""
    ms = {name: max(p["ms"][name] for p in parts) for name in parts[0]["ms"]}
    sent = {name: sum(p["sent"][name] for p in parts) for name in parts[0]["sent"]}
    diff = {name: max(p["diff"][name] for p in parts) for name in parts[0]["diff"]}
    errors: dict[str, str] = {}
    for p in parts:  # a rank's own error before "failed on another rank"
        for name, text in p.get("errors", {}).items():
            if name not in errors or errors[name] == "failed on another rank":
                errors[name] = text
    unknown = set().union(*(p["unknown"] for p in parts))
    merged = {"ms": ms, "sent": sent, "diff": diff, "errors": errors, "unknown": unknown}
    if "imbalance" in parts[0]:
        merged["imbalance"] = parts[0]["imbalance"]
    return merged


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f}"


def _fsdp_rows(world: int, label: str, count: int, r: dict[str, Any]) -> list[list[object]]:
    ours, naive, adamw = (r["ms"][name] for name in CONTENDERS)
    ratio, target = ours / naive, TARGETS.get(world)
    verdict = "" if target is None else f"<= {target:.2f}: {'yes' if ratio <= target else 'no'}"
    return [
        [
            world, label, count, f"{ours:.1f}", f"{naive:.1f}", f"{adamw:.2f}", f"{ratio:.2f}x",
            verdict, f"{ours / adamw:.1f}x", _mb(r["sent"][OURS]), _mb(r["sent"][NAIVE]),
            f"{r['diff'][NAIVE]:g}",
        ]
    ]  # fmt: skip


def _peer_rows(world: int, label: str, r: dict[str, Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for peer in PEERS:
        name = peer.label
        if name in r["errors"]:
            rows.append([world, label, name, "n/a", "n/a", "n/a", "n/a", r["errors"][name]])
            continue
        ms = r["ms"][name]
        rows.append(
            [
                world, label, name, f"{ms:.1f}", f"{ms / r['ms'][OURS]:.2f}x",
                _mb(r["sent"][name]), f"{r['diff'][name]:g}", "",
            ]
        )  # fmt: skip
    return rows


def _ddp_rows(world: int, label: str, r: dict[str, Any]) -> list[list[object]]:
    base = r["ms"][ROUND_ROBIN]
    return [
        [
            world, label, name, f"{r['ms'][name]:.2f}", f"{r['ms'][name] / base:.2f}x",
            _mb(r["sent"][name]), f"{r['imbalance'][name]:.2f}", f"{r['diff'][name]:g}",
        ]
        for name in DDP_CONTENDERS
    ]  # fmt: skip


FSDP_HEADERS = (
    "ranks", "matrices", "count", "fo.muon ms", "naive ms", "AdamW fused ms", "ours / naive",
    "target", "ours / AdamW", "ours MB/step", "naive MB/step", "max abs(ours - naive)",
)  # fmt: skip
PEER_HEADERS = (
    "ranks", "matrices", "peer", "ms", "peer / ours", "MB/step", "max abs(peer - ours)", "error",
)  # fmt: skip
DDP_HEADERS = (
    "ranks", "matrices", "owners", "step ms", "vs round-robin", "MB/step", "NS cost max/min",
    "max abs(owners - round-robin)",
)  # fmt: skip


def report(results: dict[int, list[Any]], size: Size) -> list[str]:
    """The markdown lines of :func:`run`'s results.

    Args:
        results: what :func:`run` returned.
        size: what it measured.
    """
    fsdp, peers, ddp = [], [], []
    unknown: set[str] = set()
    for world, per_rank in results.items():
        for m, (label, shapes) in enumerate(size.models):
            f = _merge([rank[m]["fsdp"] for rank in per_rank])
            z = _merge([rank[m]["ddp"] for rank in per_rank])
            unknown |= f["unknown"] | z["unknown"]
            fsdp += _fsdp_rows(world, label, len(shapes), f)
            peers += _peer_rows(world, label, f)
            ddp += _ddp_rows(world, label, z)
    how = f"median of {size.rounds} interleaved rounds, slower rank; gloo, 1 thread per rank"
    lines = [
        f"## Muon step on FSDP2 matrices ({how})",
        "",
        *table(FSDP_HEADERS, fsdp, "rl" + "r" * (len(FSDP_HEADERS) - 2)),
        "",
        f"ours / AdamW: Megatron-FSDP reports its Muon step at {MEGATRON_VS_ADAM} its Adam step "
        "(on GPUs); here Newton-Schulz runs as bfloat16 matmuls on one CPU thread per rank.",
        "MB/step: bytes the optimizer's collectives send in one step, all ranks together "
        "(measured).",
        "",
        "### Peers on the same FSDP2 params, gradients and hyperparameters "
        f"(lr {MUON['lr']}, wd {MUON['weight_decay']}, momentum {MUON['momentum']}, nesterov, "
        f"{MUON['ns_steps']} NS steps)",
        "",
        *table(PEER_HEADERS, peers, "rll" + "r" * 4 + "l"),
        "",
        *(f"- {peer.note}" for peer in PEERS),
        "",
        f"## Muon under DDP: ZeRO owners against round-robin ({how})",
        "",
        *table(DDP_HEADERS, ddp, "rll" + "r" * 5),
        "",
        "NS cost max/min: the largest over the smallest per-rank Newton-Schulz cost "
        "(sum of m * n * min(m, n) of the matrices each rank owns). In the GPT blocks every "
        "matrix has min(m, n) = d, so NS cost follows size and every plan can balance it; the "
        "Llama block's k/v (and its 3 MLP matrices per layer) are where plans differ. The "
        "round-robin's extra MB: padding of all-gathers over unlike sizes.",
    ]
    if unknown:
        lines.append(
            f"Collectives without a byte rule (not counted): {', '.join(sorted(unknown))}."
        )
    return lines


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; return the markdown report."""
    parser = benchmark_parser(__doc__, "one model, 3 rounds (< 60 s)")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    return emit(report(run(size, args.worlds), size))


if __name__ == "__main__":
    main()
