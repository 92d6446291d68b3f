"""ZeroRedundancyOptimizer under torch's DSD API (get/set_optimizer_state_dict) + dcp.save/load.

No consolidation: each rank saves its share. Every partition mode (sorted-greedy and
cost-balanced, with and without ``parameters_as_bucket_view``, and flat), flattened and nested
state dicts, saved at one world size and partition and loaded at another (2 -> 3 and 3 -> 2
ranks, every mode into every mode, and from and into a plain ``torch.optim.AdamW``: the layout
is torch's). The reference is a single-process ``torch.optim.AdamW`` on the same gradients
(every rank gets the same ones, as after DDP); ZeRO's local optimizers run torch's own
per-tensor kernels on whole parameters or on contiguous pieces, so every comparison is bitwise.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from compat_api.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from tests._world import World

pytestmark = pytest.mark.distributed

SHAPES = [(7, 5), (13,), (3, 4, 2), (), (33,), (2, 9), (40,)]
KWARGS: dict[str, Any] = {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}
MODES: dict[str, dict[str, Any]] = {
    "sorted_greedy": {},
    "sorted_greedy_bucket_view": {"parameters_as_bucket_view": True},
    "cost_balanced": {"partition": "cost_balanced"},
    "cost_balanced_bucket_view": {"partition": "cost_balanced", "parameters_as_bucket_view": True},
    "flat": {"partition": "flat"},
}
SAVED_AFTER = 3  # steps before the checkpoint
RESUMED_FOR = 2  # steps after it


@pytest.fixture(scope="module")
def world2() -> Any:
    with World(2) as world:
        yield world


@pytest.fixture(scope="module")
def world3() -> Any:
    with World(3) as world:
        yield world


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for i, shape in enumerate(SHAPES):
            value = torch.randn(shape, generator=gen, dtype=torch.float64)
            self.register_parameter(f"w{i}", nn.Parameter(value))


def _groups(model: nn.Module, lr2: float = 0.003) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:3]}, {"params": params[3:], "lr": lr2}]


def _set_grads(model: nn.Module, step: int) -> None:
    for i, p in enumerate(model.parameters()):
        gen = torch.Generator().manual_seed(100 * step + i)
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        _set_grads(model, step)
        optim.step()
        optim.zero_grad(set_to_none=True)


def _reference(steps: int) -> _Net:
    model = _Net()
    _train(model, torch.optim.AdamW(_groups(model), **KWARGS), range(steps))
    return model


def _zero(model: nn.Module, mode: str, lr2: float = 0.003) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(_groups(model, lr2), torch.optim.AdamW, **MODES[mode], **KWARGS)


def _optimizer(model: nn.Module, mode: str, lr2: float = 0.003) -> torch.optim.Optimizer:
    """ZeRO in ``mode``, or (``"plain"``) a ``torch.optim.AdamW`` on every rank."""
    if mode == "plain":
        return torch.optim.AdamW(_groups(model, lr2), **KWARGS)
    return _zero(model, mode, lr2)


def _mismatches(model: nn.Module, want: nn.Module) -> list[str]:
    return [
        name
        for (name, p), q in zip(model.named_parameters(), want.parameters())
        if not torch.equal(p, q)
    ]


def _options(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _save_all(rank: int, world_size: int, root: str) -> list[str]:
    """Train, save through DSD in every mode (and from a plain AdamW), train on: the live run
    must not notice."""
    errors: list[str] = []
    want = _reference(SAVED_AFTER + RESUMED_FOR)
    for mode in [*MODES, "plain"]:
        for flatten in (False, True):
            model = _Net()
            zero = _optimizer(model, mode)
            _train(model, zero, range(SAVED_AFTER))
            osd = get_optimizer_state_dict(model, zero, options=_options(flatten))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's ShardedTensor notice
                dcp.save({"optim": osd}, checkpoint_id=f"{root}/{mode}-{flatten}")
            if isinstance(zero, ZeroRedundancyOptimizer):
                try:
                    zero.state_dict()
                    errors.append(f"{mode}: a direct state_dict() did not raise")
                except RuntimeError as error:
                    if "has not been consolidated" not in str(error):
                        errors.append(f"{mode}: {error}")
                if len(zero.state) != 0:
                    errors.append(f"{mode}: the wrapper's own state is not torch's (empty)")
            _train(model, zero, range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR))
            bad = _mismatches(model, want)
            if bad:
                errors.append(f"save {mode} flatten={flatten}: the live run changed at {bad}")
    return errors


def _load_all(rank: int, world_size: int, root: str) -> list[str]:
    """Load every checkpoint into every mode (fresh optimizers), and into a plain
    ``torch.optim.AdamW`` (the layout is torch's), and resume."""
    errors: list[str] = []
    at_save = _reference(SAVED_AFTER)
    want = _reference(SAVED_AFTER + RESUMED_FOR)
    for saved in [*MODES, "plain"]:
        for flatten in (False, True):
            for mode in [*MODES, "plain"]:
                model = _Net()
                with torch.no_grad():
                    for p, q in zip(model.parameters(), at_save.parameters()):
                        p.copy_(q)
                zero = _optimizer(model, mode, lr2=0.5)  # the checkpoint's lr must win
                osd = get_optimizer_state_dict(model, zero, options=_options(flatten))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    dcp.load({"optim": osd}, checkpoint_id=f"{root}/{saved}-{flatten}")
                set_optimizer_state_dict(model, zero, osd, options=_options(flatten))
                label = f"{saved} -> {mode} flatten={flatten}"
                local = getattr(zero, "optim", zero)
                if zero.param_groups[1]["lr"] != 0.003 or local.param_groups[1]["lr"] != 0.003:
                    errors.append(f"{label}: lr not loaded")
                _train(model, zero, range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR))
                bad = _mismatches(model, want)
                if bad:
                    errors.append(f"{label}: resumed params differ at {bad}")
    return errors


def test_save_2_ranks_load_3_ranks(world2: World, world3: World, tmp_path: Path) -> None:
    assert world2.run(_save_all, str(tmp_path)) == [[], []]
    assert world3.run(_load_all, str(tmp_path)) == [[], [], []]


def test_save_3_ranks_load_2_ranks(world2: World, world3: World, tmp_path: Path) -> None:
    assert world3.run(_save_all, str(tmp_path)) == [[], [], []]
    assert world2.run(_load_all, str(tmp_path)) == [[], []]


def _fresh_init(rank: int, world_size: int) -> list[str]:
    """DSD on a fresh optimizer: params unchanged, the state torch's own init step makes."""
    errors: list[str] = []
    plain_model = _Net()
    plain = torch.optim.AdamW(_groups(plain_model), **KWARGS)
    get_optimizer_state_dict(plain_model, plain)
    plain_state = [
        {k: v.clone() for k, v in plain.state[p].items()} for p in plain_model.parameters()
    ]
    _train(plain_model, plain, range(2))
    for mode in MODES:
        model = _Net()
        before = [p.detach().clone() for p in model.parameters()]
        zero = _zero(model, mode)
        if zero.state:
            errors.append(f"{mode}: a fresh optimizer reports state")
        get_optimizer_state_dict(model, zero)
        if _mismatches(model, _as_net(before)):
            errors.append(f"{mode}: the init step changed the parameters")
        for tensor, piece in zero.strategy.owned_pieces(zero).items():
            ours = zero.optim.state[tensor]
            theirs = plain_state[piece.param_index]
            if set(ours) != set(theirs):
                errors.append(f"{mode}: state names {sorted(ours)} != {sorted(theirs)}")
                continue
            for name, value in theirs.items():
                expected = value.reshape(-1)[piece.start : piece.stop] if value.dim() else value
                if not torch.equal(ours[name].reshape(expected.shape), expected):
                    errors.append(f"{mode}: {name} of parameter {piece.param_index} differs")
        _train(model, zero, range(2))  # then the run goes on as torch's would
        bad = _mismatches(model, plain_model)
        if bad:
            errors.append(f"{mode}: after the init, training differs from torch at {bad}")
    return errors


def _as_net(values: list[torch.Tensor]) -> nn.Module:
    net = _Net()
    with torch.no_grad():
        for p, v in zip(net.parameters(), values):
            p.copy_(v)
    return net


@pytest.mark.parametrize("world_name", ["world2", "world3"])
def test_fresh_optimizer_init(world_name: str, request: pytest.FixtureRequest) -> None:
    world: World = request.getfixturevalue(world_name)
    assert world.run(_fresh_init) == [[]] * world.world_size


def _bad_load(rank: int, world_size: int) -> list[str]:
    """A named state dict that does not fit raises torch's errors and changes nothing."""
    out = []
    for mode in ("sorted_greedy", "flat"):
        model = _Net()
        zero = _zero(model, mode)
        _train(model, zero, range(1))
        osd = get_optimizer_state_dict(model, zero)
        before = {t: {k: v.clone() for k, v in s.items()} for t, s in zero.optim.state.items()}
        short = {**osd, "param_groups": osd["param_groups"][:1]}
        smaller = {
            **osd,
            "param_groups": [osd["param_groups"][0], {**osd["param_groups"][1], "params": []}],
        }
        for bad in (short, smaller):
            try:
                zero.load_state_dict(bad)
                out.append(f"{mode}: no error")
            except ValueError as error:
                out.append(str(error))
        same = all(
            torch.equal(v, zero.optim.state[t][k]) for t, s in before.items() for k, v in s.items()
        )
        out.append(f"{mode} unchanged={same}")
    return out


def test_bad_named_state_dict_raises_before_loading(world2: World) -> None:
    got = world2.run(_bad_load)[0]
    assert got == [
        "loaded state dict has a different number of parameter groups",
        "loaded state dict contains a parameter group that doesn't match the size of "
        "optimizer's group",
        "sorted_greedy unchanged=True",
        "loaded state dict has a different number of parameter groups",
        "loaded state dict contains a parameter group that doesn't match the size of "
        "optimizer's group",
        "flat unchanged=True",
    ]
