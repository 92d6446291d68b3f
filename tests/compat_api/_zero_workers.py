"""Per-rank workers for the ZeroRedundancyOptimizer tests (run inside tests._world.World).

Every worker checks our ZeroRedundancyOptimizer against torch's own ZeroRedundancyOptimizer and
a plain single-process ``torch.optim`` optimizer on the same data, asserting inside the rank and
returning small picklable summaries for cross-rank checks in the parent.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

import functional_optim as fo
from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer as OurZeRO
from compat_api.zero_redundancy_optimizer import _broadcast_object

with warnings.catch_warnings():
    # torch.distributed.optim scripts interfaces at import; torch 2.13 deprecates TorchScript.
    warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 0.01, "betas": (0.8, 0.99)}),
}


def make_model(seed: int = 0, frozen: bool = True) -> nn.Sequential:
    """A small MLP whose parameter sizes give an uneven partition; optionally a frozen layer."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 5), nn.Linear(5, 3)
    )
    if frozen:
        model[4].weight.requires_grad_(False)
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups: weights without decay, biases with decay and their own lr."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "weight_decay": 0.0},
        {"params": biases, "weight_decay": 0.01, "lr": 0.02},
    ]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent data (the same on every run)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def averaged_grads(model: nn.Module, rank: int, world_size: int, step: int) -> torch.Tensor:
    """Set every gradient to the world average for this step; return the loss."""
    model.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world_size
    return loss.detach()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def equal_models(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def run_parity(rank: int, world_size: int, name: str, bucket_view: bool, steps: int) -> list[float]:
    """Train ours, torch's ZeRO and a plain optimizer side by side; assert bitwise equality.

    Uses two param groups, a frozen layer, an LR scheduler on each, and a closure on odd steps.
    """
    cls, kwargs = OPTIMIZERS[name]
    models = [make_model() for _ in range(3)]
    ours = OurZeRO(param_groups(models[0]), cls, parameters_as_bucket_view=bucket_view, **kwargs)
    theirs = TorchZeRO(
        param_groups(models[1]), cls, parameters_as_bucket_view=bucket_view, **kwargs
    )
    plain = cls(param_groups(models[2]), **kwargs)
    optimizers: list[Any] = [ours, theirs, plain]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers]
    for step in range(steps):
        losses = []
        for model, optim in zip(models, optimizers):
            if step % 2:

                def closure(model: nn.Module = model, step: int = step) -> torch.Tensor:
                    return averaged_grads(model, rank, world_size, step)

                losses.append(optim.step(closure))
            else:
                averaged_grads(model, rank, world_size, step)
                losses.append(optim.step())
        for scheduler in schedulers:
            scheduler.step()
        if step % 2:
            assert torch.equal(losses[0], losses[2])
            assert torch.equal(losses[1], losses[2])
        assert equal_models(models[0], models[1]), f"ours != torch ZeRO at step {step}"
        assert equal_models(models[0], models[2]), f"ours != plain {name} at step {step}"
    for g_ours, g_plain in zip(ours.param_groups, plain.param_groups):
        assert g_ours["lr"] == g_plain["lr"]
    return flat(models[0]).tolist()


def random_sizes(seed: int) -> list[list[tuple[int, ...]]]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        shapes = []
        for _ in range(n):
            if torch.rand(1, generator=gen) < 0.3:
                shapes.append((int(torch.randint(1, 4, (1,), generator=gen)) * 4,))
            else:
                shapes.append(tuple(int(s) for s in torch.randint(1, 7, (2,), generator=gen)))
        groups.append(shapes)
    return groups


def run_partition(rank: int, world_size: int, seeds: list[int]) -> list[list[int]]:
    """Our partition equals torch's on random models; each rank holds state only for its shard."""
    owners = []
    for seed in seeds:
        shapes = random_sizes(seed)
        params = [[torch.zeros(s, requires_grad=True) for s in group] for group in shapes]
        ours = OurZeRO([{"params": g} for g in params], torch.optim.Adam, lr=0.1)
        theirs = TorchZeRO([{"params": g} for g in params], torch.optim.Adam, lr=0.1)
        ours_part = ours._partition_parameters()
        theirs_part = theirs._partition_parameters()
        assert len(ours_part) == len(theirs_part) == world_size
        for our_groups, their_groups in zip(ours_part, theirs_part):
            assert len(our_groups) == len(their_groups)
            for a, b in zip(our_groups, their_groups):
                assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
        assert ours._param_to_rank == theirs._param_to_rank
        assert ours._index_to_param == theirs._index_to_param
        assert ours._param_to_index == theirs._param_to_index
        # Each rank's local optimizer holds state for exactly its own parameters.
        for group in params:
            for p in group:
                p.grad = torch.ones_like(p)
        ours.step()
        mine = {p for g in ours_part[rank] for p in g["params"]}
        assert set(ours.optim.state) == mine
        assert len(ours.state) == 0
        owners.append([ours._param_to_rank[p] for g in params for p in g])
    return owners


def _train(model: nn.Module, optim: Any, rank: int, world_size: int, steps: range) -> None:
    for step in steps:
        averaged_grads(model, rank, world_size, step)
        optim.step()


def _assert_state_dicts_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"], (a["param_groups"], b["param_groups"])
    assert list(a["state"]) == list(b["state"])
    for index, state in a["state"].items():
        other = b["state"][index]
        assert set(state) == set(other), (index, set(state), set(other))
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[key]), (index, key)
            else:
                assert value == other[key], (index, key)


def run_state_dict(rank: int, world_size: int, name: str, bucket_view: bool) -> list[float]:
    """Consolidate on ranks 0 and 1, compare with the plain optimizer, reload and continue."""
    cls, kwargs = OPTIMIZERS[name]
    models = [make_model() for _ in range(3)]
    ours = OurZeRO(param_groups(models[0]), cls, parameters_as_bucket_view=bucket_view, **kwargs)
    plain = cls(param_groups(models[1]), **kwargs)
    theirs = TorchZeRO(
        param_groups(models[2]), cls, parameters_as_bucket_view=bucket_view, **kwargs
    )
    for model, optim in zip(models, (ours, plain, theirs)):
        _train(model, optim, rank, world_size, range(3))
    expected = plain.state_dict()
    for to in (0, 1):
        ours.consolidate_state_dict(to=to)
        theirs.consolidate_state_dict(to=to)
        if rank == to:
            _assert_state_dicts_equal(ours.state_dict(), expected)
            _assert_state_dicts_equal(ours.state_dict(), theirs.state_dict())
        else:
            message = _expect(RuntimeError, ours.state_dict)
            assert f"consolidate_state_dict(to={rank})" in message
    holder = [ours.state_dict() if rank == 1 else None]
    dist.broadcast_object_list(holder, src=1)
    ours_sd: dict[str, Any] = holder[0]
    holder = [theirs.state_dict() if rank == 1 else None]
    dist.broadcast_object_list(holder, src=1)
    theirs_sd: dict[str, Any] = holder[0]

    # Fresh copies of the trained model, each optimizer loaded from a different checkpoint.
    fresh = [copy.deepcopy(models[0]) for _ in range(5)]
    loaded: list[Any] = [
        OurZeRO(param_groups(fresh[0]), cls, parameters_as_bucket_view=bucket_view, lr=1.0),
        cls(param_groups(fresh[1]), **kwargs),
        OurZeRO(param_groups(fresh[2]), cls, lr=1.0),  # ours <- torch ZeRO's checkpoint
        TorchZeRO(param_groups(fresh[3]), cls, lr=1.0),  # torch ZeRO <- our checkpoint
        OurZeRO(param_groups(fresh[4]), cls, lr=1.0),  # ours <- plain checkpoint
    ]
    sources = [ours_sd, ours_sd, theirs_sd, ours_sd, expected]
    for optim, source in zip(loaded, sources):
        # Each load gets its own copy: loading shares tensors with the dict (torch semantics).
        argument = copy.deepcopy(source)
        snapshot = copy.deepcopy(argument)
        optim.load_state_dict(argument)
        if not isinstance(optim, TorchZeRO):  # torch's ZeRO overwrites non-owned entries
            _assert_state_dicts_equal(argument, snapshot)
    _train(models[1], plain, rank, world_size, range(3, 6))
    for model, optim in zip(fresh, loaded):
        _train(model, optim, rank, world_size, range(3, 6))
        assert equal_models(model, models[1]), f"diverged after loading into {type(optim)}"
    return flat(fresh[0]).tolist()


def run_join(rank: int, world_size: int, bucket_view: bool) -> list[float]:
    """DDP + Join with uneven inputs (rank r has 2 + r batches): ours matches torch's ZeRO."""
    finals = []
    for zero_cls in (TorchZeRO, OurZeRO):
        model = DistributedDataParallel(make_model(frozen=False))
        optim = zero_cls(
            model.parameters(), torch.optim.Adam, parameters_as_bucket_view=bucket_view, lr=0.01
        )
        with Join([model, optim]):
            for step in range(2 + rank):
                optim.zero_grad()
                x, y = batch(rank, step)
                nn.functional.mse_loss(model(x), y).backward()
                optim.step()
        finals.append(flat(model.module))
    assert torch.equal(finals[0], finals[1])
    return finals[1].tolist()


def run_add_param_group_and_trainability(rank: int, world_size: int, bucket_view: bool) -> bool:
    """add_param_group repartitions like torch; trainability changes rebuild buckets like torch."""
    models = [make_model(frozen=False) for _ in range(3)]
    optims: list[Any] = []
    for zero_cls, model in zip((OurZeRO, TorchZeRO), models):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        optim = zero_cls(weights, torch.optim.AdamW, parameters_as_bucket_view=bucket_view, lr=0.01)
        optim.add_param_group({"params": biases, "weight_decay": 0.1})
        optims.append(optim)
    weights = [p for n, p in models[2].named_parameters() if n.endswith("weight")]
    biases = [p for n, p in models[2].named_parameters() if n.endswith("bias")]
    plain = torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "weight_decay": 0.1}], lr=0.01
    )
    optims.append(plain)
    owners = [[o._param_to_rank[p] for p in m.parameters()] for o, m in zip(optims[:2], models)]
    assert owners[0] == owners[1]
    assert len(optims[0].optim.param_groups) == len(optims[1].optim.param_groups) == 2
    for step in range(4):
        if step == 2:
            for model in models:
                model[0].weight.requires_grad_(False)
        for model, optim in zip(models, optims):
            averaged_grads(model, rank, world_size, step)
            optim.step()
        assert equal_models(models[0], models[1]), f"ours != torch at step {step}"
        assert equal_models(models[0], models[2]), f"ours != plain at step {step}"
    return True


def _expect(error: type[BaseException], fn: Callable[[], object]) -> str:
    try:
        fn()
    except error as caught:
        return f"{type(caught).__name__}: {caught}"
    raise AssertionError(f"expected {error.__name__}")


def run_bad_input(rank: int, world_size: int) -> list[str]:
    """Errors that need a process group: clear, identical on all ranks, nothing mutated."""
    from torch.distributed.optim.functional_sgd import _FunctionalSGD

    model = make_model(frozen=False)
    messages = [
        _expect(TypeError, lambda: OurZeRO(model.parameters(), int, lr=0.1)),
        _expect(TypeError, lambda: OurZeRO(model.parameters(), 3, lr=0.1)),
        _expect(ValueError, lambda: OurZeRO(model.parameters(), _FunctionalSGD, lr=0.1)),
    ]
    # torch raises the same ValueError for a functional class.
    their = _expect(ValueError, lambda: TorchZeRO(model.parameters(), _FunctionalSGD, lr=0.1))
    assert messages[2] == their, (messages[2], their)

    ours = OurZeRO(model.parameters(), torch.optim.Adam, lr=0.01)
    theirs = TorchZeRO(model.parameters(), torch.optim.Adam, lr=0.01)
    assert _expect(RuntimeError, ours.state_dict) == _expect(RuntimeError, theirs.state_dict)
    _train(model, ours, rank, world_size, range(2))
    ours.consolidate_state_dict(0)
    state_dict: dict[str, Any] = _broadcast_object(ours.state_dict() if rank == 0 else None, 0)
    local_before = copy.deepcopy(ours.optim.state_dict())
    params_before = flat(model)

    short = copy.deepcopy(state_dict)
    short["param_groups"][0]["params"] = short["param_groups"][0]["params"][:-1]
    two_groups = copy.deepcopy(state_dict)
    two_groups["param_groups"].append({**two_groups["param_groups"][0], "params": []})
    messages.append(_expect(ValueError, lambda: ours.load_state_dict(short)))
    messages.append(_expect(ValueError, lambda: ours.load_state_dict(two_groups)))
    messages.append(_expect(ValueError, lambda: ours.consolidate_state_dict(to=world_size)))
    messages.append(
        _expect(ValueError, lambda: ours.add_param_group({"params": [torch.zeros(2).double()]}))
    )
    _assert_state_dicts_equal(ours.optim.state_dict(), local_before)
    assert torch.equal(flat(model), params_before)
    assert len(ours.param_groups) == 1
    # The world is still usable: a normal step and consolidation go through.
    _train(model, ours, rank, world_size, range(2, 3))
    ours.consolidate_state_dict(world_size - 1)
    return messages


class FoAdam(fo.Optimizer):
    """A functional_optim-based torch.optim.Optimizer with a torch-like constructor."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__(params, fo.adam(lr=lr, weight_decay=weight_decay))


def run_functional_optim(rank: int, world_size: int, bucket_view: bool) -> list[float]:
    """A functional_optim.Optimizer as the local optimizer: parity and a checkpoint round trip."""
    models = [make_model() for _ in range(3)]
    ours = OurZeRO(param_groups(models[0]), FoAdam, parameters_as_bucket_view=bucket_view, lr=0.01)
    plain = FoAdam(param_groups(models[1]), lr=0.01)
    for model, optim in zip(models, (ours, plain)):
        _train(model, optim, rank, world_size, range(3))
    assert equal_models(models[0], models[1])
    ours.consolidate_state_dict(to=0)
    checkpoint = _broadcast_object(ours.state_dict() if rank == 0 else None, 0)
    expected = plain.state_dict()
    assert list(checkpoint["state"]) == list(expected["state"])
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert torch.equal(
                torch.as_tensor(checkpoint["state"][index][key]), torch.as_tensor(value)
            )
    models[2].load_state_dict(models[0].state_dict())
    fresh = OurZeRO(param_groups(models[2]), FoAdam, lr=1.0)
    fresh.load_state_dict(checkpoint)
    for model, optim in zip(models[1:], (plain, fresh)):
        _train(model, optim, rank, world_size, range(3, 5))
    assert equal_models(models[1], models[2]), "diverged after loading the consolidated state"
    return flat(models[2]).tolist()
