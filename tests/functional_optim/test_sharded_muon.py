"""fo.muon on FSDP2 (DTensor ``Shard(0)``) params: each matrix orthogonalised on one owner rank.

One 2-rank gloo world. Reference: single-process ``torch.optim.Muon`` (matrices) and
``torch.optim.AdamW`` (vectors, a second optimizer as torch's Muon recipe has it) on the
unsharded model, fed the same (full) gradients. Tolerance: bitwise. The momentum is
element-wise on shards, the owner orthogonalises exactly the bfloat16 cast of the full
direction (the cast is element-wise), and the step is element-wise again, so every op sees the
numbers torch's does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import functional_optim as fo
import functional_optim._sharded_matrix as sharded_matrix
from functional_optim._owner_compute import assign_owners
from tests._world import World

# 7 x 5 and 33 x 9 split unevenly over 2 ranks; 1 x 6 leaves rank 1 an empty shard
SHAPES = {"w1": (16, 24), "w2": (24, 16), "w3": (7, 5), "w4": (33, 9), "w5": (1, 6)}
VECTORS = {"b1": 16, "b2": 5}
STEPS = 3


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape) * 0.3))
        for name, size in VECTORS.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(size) * 0.1))

    def forward(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 + step)
        x, u, v, s = (torch.randn(4, k, generator=gen) for k in (16, 7, 33, 1))
        h = torch.tanh(x @ self.w1) @ self.w2 + self.b1
        return (
            h.square().mean()
            + torch.tanh(u @ self.w3 + self.b2).square().mean()
            + (v @ self.w4).square().mean()
            + (s @ self.w5).square().mean()
        )


def _split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    named = dict(model.named_parameters())
    return [named[n] for n in SHAPES], [named[n] for n in VECTORS]


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def _check_vs_torch(
    rank: int, world_size: int, nesterov: bool, adjust: str | None, tensor_lr: bool = False
) -> bool:
    from torch.distributed.fsdp import fully_shard

    muon_args: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9}
    muon_args["nesterov"] = nesterov
    if tensor_lr:  # torch computes the step size from a tensor lr in tensor maths
        muon_args["lr"] = torch.tensor(0.05)
    model, ref = fully_shard(_Net()), _Net()
    mats, vecs = _split(model)
    ref_mats, ref_vecs = _split(ref)
    opts = [
        fo.Optimizer(mats, fo.muon(**muon_args, adjust_lr_fn=adjust)),  # type: ignore[arg-type]
        fo.Optimizer(vecs, fo.adamw(lr=1e-2, weight_decay=0.01)),
    ]
    refs = [
        torch.optim.Muon(ref_mats, **muon_args, adjust_lr_fn=adjust),  # type: ignore[arg-type]
        torch.optim.AdamW(ref_vecs, lr=1e-2, weight_decay=0.01),
    ]
    assert [p._local_tensor.shape[0] for p in mats][-1] == (1 - rank)  # type: ignore[attr-defined]
    for step in range(STEPS):
        model(step).backward()
        for p, q in zip([*mats, *vecs], [*ref_mats, *ref_vecs], strict=True):
            q.grad = _full(p.grad)
        for opt in (*opts, *refs):
            opt.step()
            opt.zero_grad()
    for p, q in zip([*mats, *vecs], [*ref_mats, *ref_vecs], strict=True):
        assert torch.equal(_full(p), q.detach()), (rank, p.shape, (_full(p) - q).abs().max())
    ours, theirs = opts[0].state_dict()["state"], refs[0].state_dict()["state"]
    for k in range(len(mats)):
        buf = ours[k]["momentum_buffer"]
        assert type(buf).__name__ == "DTensor"
        assert buf.placements == mats[k].placements
        assert torch.equal(buf.full_tensor(), theirs[k]["momentum_buffer"]), k
    return True


def _count_newton_schulz(rank: int, world_size: int) -> list[tuple[int, int]]:
    """The shapes this rank orthogonalised over STEPS steps (``newton_schulz`` wrapped)."""
    from torch.distributed.fsdp import fully_shard

    seen: list[tuple[int, int]] = []
    original = sharded_matrix.newton_schulz

    def counting(grad: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.append((grad.size(0), grad.size(1)))
        return original(grad, *args)

    model = fully_shard(_Net())
    mats, _ = _split(model)
    opt = fo.Optimizer(mats, fo.muon(lr=0.05))
    sharded_matrix.newton_schulz = counting  # type: ignore[assignment]
    try:
        for step in range(STEPS):
            model(step).backward()
            opt.step()
            opt.zero_grad()
    finally:
        sharded_matrix.newton_schulz = original
    return seen


def _check_errors(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    messages: list[str] = []
    model = fully_shard(_Net())
    _, vecs = _split(model)
    with pytest.raises(ValueError, match="Muon only supports 2D parameters") as info:
        fo.Optimizer(vecs, fo.muon(lr=0.05))  # 1-D params without an AdamW fallback
    messages.append(str(info.value))

    mesh = init_device_mesh("cpu", (world_size,))
    partial = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 3), mesh, [Partial()]))
    column = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))
    row = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    unfused = fo.chain(fo.scale_by_muon(), fo.scale_by_learning_rate(0.05))  # no fused step
    del column  # Shard(1) is stepped (test_tensor_parallel_placements_match_torch_bitwise)
    cases = (([partial], fo.muon(lr=0.05)), ([row], unfused))
    for params, tx in cases:
        for p in params:
            p.grad = torch.ones_like(p)
        opt = fo.Optimizer(params, tx)
        before = [p._local_tensor.clone() for p in params]  # type: ignore[attr-defined]
        with pytest.raises(ValueError) as info:
            opt.step()
        messages.append(str(info.value))
        after = [p._local_tensor for p in params]  # type: ignore[attr-defined]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert not opt.state_dict()["state"], "state was created"
    return messages


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", [None, "match_rms_adamw"])
def test_fsdp2_muon_matches_torch_bitwise(
    world2: World, nesterov: bool, adjust: str | None
) -> None:
    assert world2.run(_check_vs_torch, nesterov, adjust) == [True, True]


def test_fsdp2_muon_tensor_lr_matches_torch_bitwise(world2: World) -> None:
    assert world2.run(_check_vs_torch, True, "match_rms_adamw", True) == [True, True]


def test_each_matrix_orthogonalised_on_exactly_one_rank(world2: World) -> None:
    seen = world2.run(_count_newton_schulz)
    shapes = list(SHAPES.values())
    owners = assign_owners(shapes, 2)
    for rank, shapes_seen in enumerate(seen):
        expected = [s for s, o in zip(shapes, owners, strict=True) if o == rank]
        assert sorted(shapes_seen) == sorted(expected * STEPS), (rank, shapes_seen)
    assert sorted(seen[0] + seen[1]) == sorted(shapes * STEPS)
    assert seen[0]  # both ranks work
    assert seen[1]


def test_bad_input_raises_before_any_change(world2: World) -> None:
    on_ranks = world2.run(_check_errors)
    assert on_ranks[0] == on_ranks[1]
    one_d, partial, unfused = on_ranks[0]
    assert "ScaleByMuonState needs whole tensors" in unfused
    assert "Muon only supports 2D parameters" in one_d
    assert "param 0 of param group 0 has placement" in partial
