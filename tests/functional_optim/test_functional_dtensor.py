"""The TorchScript ``FunctionalX`` optimizers on FSDP2 (DTensor) params, in eager mode.

Each steps the local shards as plain tensors: the result must be bitwise the same optimizer
run on plain copies of the local shards with the local gradients, the buffers must stay
DTensors shaped like their params, and torch's own optimizer on the same FSDP2 model must
agree bitwise where it runs the same kernel. Optimizers that read whole tensors (Muon,
Adafactor) refuse sharded params before touching anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from functional_optim import functional as fn
from tests._world import World

WIDTHS = (8, 5, 6)  # odd sizes: FSDP2 shards of unequal length

CASES: dict[str, Callable[[list[torch.Tensor]], Any]] = {
    "adam": lambda ps: fn.FunctionalAdam(ps, lr=1e-2, weight_decay=0.01),
    "adamw_amsgrad": lambda ps: fn.FunctionalAdamW(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: fn.FunctionalSGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd_single": lambda ps: fn.FunctionalSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: fn.FunctionalAdagrad(ps, lr=0.1),
    "rmsprop": lambda ps: fn.FunctionalRMSprop(ps, lr=1e-2, momentum=0.5),
    "rprop": lambda ps: fn.FunctionalRprop(ps, lr=1e-2),
    "adadelta": lambda ps: fn.FunctionalAdadelta(ps, lr=1.0),
    "adamax": lambda ps: fn.FunctionalAdamax(ps, lr=1e-2),
    "nadam": lambda ps: fn.FunctionalNAdam(ps, lr=1e-2),
    "radam": lambda ps: fn.FunctionalRAdam(ps, lr=1e-2),
    "asgd": lambda ps: fn.FunctionalASGD(ps, lr=1e-2),
}


class _DTensorOps(TorchDispatchMode):
    """Counts the ops that reach a DTensor (each one a trip through DTensor dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        self.count += any(hasattr(t, "_local_tensor") for t in leaves)
        return func(*args, **(kwargs or {}))


def _fsdp_model() -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.Tanh(), torch.nn.Linear(*WIDTHS[1:])
    )
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _backward(model: torch.nn.Module, step: int) -> None:
    x = torch.randn(4, WIDTHS[0], generator=torch.Generator().manual_seed(100 + step))
    model(x).square().mean().backward()


def _check_case(rank: int, world_size: int, name: str) -> list[str]:
    model = _fsdp_model()
    params = list(model.parameters())
    local = [p._local_tensor.detach().clone() for p in params]  # type: ignore[attr-defined]
    sharded, plain = CASES[name](params), CASES[name](local)
    errors = []
    for step in range(3):
        _backward(model, step)
        grads = [p.grad for p in params]
        with torch.no_grad(), _DTensorOps() as ops:
            sharded.step(grads)
        if step > 0 and ops.count:  # the first step creates the state buffers like the params
            errors.append(f"{name}: {ops.count} ops went through DTensor dispatch at step {step}")
        plain.step([g._local_tensor.clone() for g in grads])  # type: ignore[union-attr]
        model.zero_grad()
    for i, (p, q) in enumerate(zip(params, local, strict=True)):
        if not torch.equal(p._local_tensor, q):  # type: ignore[attr-defined]
            errors.append(f"{name}: param {i} differs from the plain local step")
        for key, buf in sharded.state[p].items():
            if buf.dim() > 0 and type(buf) is not type(p):
                errors.append(f"{name}: state {key!r} of param {i} is {type(buf).__name__}")
            if buf.dim() > 0 and not torch.equal(buf._local_tensor, plain.state[q][key]):
                errors.append(f"{name}: state {key!r} of param {i} differs")
    return errors


def _check_against_torch(rank: int, world_size: int) -> list[str]:
    """FunctionalAdamW (torch's fused kernel on CPU) vs torch.optim.AdamW(fused) on FSDP2."""
    ours, theirs = _fsdp_model(), _fsdp_model()
    functional = fn.FunctionalAdamW(list(ours.parameters()), lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        for model in (ours, theirs):
            _backward(model, step)
        with torch.no_grad():
            functional.step([p.grad for p in ours.parameters()])
        torch_opt.step()
        ours.zero_grad()
        theirs.zero_grad()
    return [
        f"param {i} differs from torch.optim.AdamW(fused=True)"
        for i, (p, q) in enumerate(zip(ours.parameters(), theirs.parameters(), strict=True))
        if not torch.equal(p.full_tensor(), q.full_tensor())  # type: ignore[operator]
    ]


def _check_refusals(rank: int, world_size: int) -> list[str]:
    model = _fsdp_model()
    _backward(model, 0)
    params = list(model.parameters())
    before = [p._local_tensor.clone() for p in params]  # type: ignore[attr-defined]
    messages = []
    matrices = [p for p in params if p.dim() == 2]
    for make in (
        lambda: fn.FunctionalMuon(matrices),
        lambda: fn.FunctionalAdafactor(params),
    ):
        opt = make()
        grads = [p.grad for p in opt.param_group["params"]]
        with pytest.raises(ValueError, match="sharded DTensor") as info:
            opt.step(grads)
        messages.append(str(info.value))
        if opt.state:
            messages.append("state was created before the refusal")
    adam = fn.FunctionalAdam(params)
    with pytest.raises(TypeError, match="param 0 is a DTensor but its gradient is a plain"):
        adam.step([p.grad._local_tensor for p in params])  # type: ignore[union-attr]
    changed = [
        i
        for i, (p, b) in enumerate(zip(params, before, strict=True))
        if not torch.equal(p._local_tensor, b)  # type: ignore[attr-defined]
    ]
    if changed:
        messages.append(f"params {changed} changed")
    return messages


@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    with World(2) as world:
        yield world


@pytest.mark.parametrize("name", sorted(CASES))
def test_functional_steps_local_shards(world2: World, name: str) -> None:
    for errors in world2.run(_check_case, name):
        assert errors == []


def test_functional_adamw_matches_torch_fused_on_fsdp2(world2: World) -> None:
    for errors in world2.run(_check_against_torch):
        assert errors == []


def test_whole_tensor_functionals_refuse_shards(world2: World) -> None:
    for messages in world2.run(_check_refusals):
        assert len(messages) == 2, messages
        assert "Muon: param 0 is a sharded DTensor" in messages[0]
        assert "Adafactor: param 0 is a sharded DTensor" in messages[1]
