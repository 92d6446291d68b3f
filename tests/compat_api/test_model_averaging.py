"""compat_api.algorithms.model_averaging: validation, warnings, schedule and values as torch's."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook as torch_hook
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hier
import torch.distributed.algorithms.model_averaging.utils as torch_utils

import compat_api.algorithms.ddp_comm_hooks as our_hooks_pkg
import compat_api.algorithms.ddp_comm_hooks.post_localSGD_hook as our_hook
import compat_api.algorithms.model_averaging as our_averaging_pkg
import compat_api.algorithms.model_averaging.averagers as our_averagers
import compat_api.algorithms.model_averaging.hierarchical_model_averager as our_hier
import compat_api.algorithms.model_averaging.utils as our_utils
from tests._world import World

pytestmark = pytest.mark.distributed


def test_public_names_exist() -> None:
    for module in (our_averagers, our_hier, our_utils, our_hook):
        for name in module.__all__:
            assert getattr(module, name) is not None
    assert our_averagers.__all__ == ["ModelAverager", "PeriodicModelAverager"]
    assert set(our_utils.__all__) == set(torch_utils.__all__)
    assert our_hooks_pkg.__all__ == []
    assert our_averaging_pkg.__all__ == [
        "DiLoCoAverager",
        "HierarchicalDiLoCoAverager",
        "MuonAdamW",
        "SparseLoCoAverager",
        "WarmStartDiLoCoAverager",
        "default_outer",
        "muloco",
        "slowmo_averager",
    ]


# -- bad input: same exception type and message as torch, same warnings ----------------------------


def _outcome(make: Callable[[], Any]) -> tuple[str, str, list[tuple[str, str]]]:
    """(exception type, message, [(warning category, message)]) of calling ``make``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            make()
            error = ("", "")
        except Exception as exc:  # the point is to compare exceptions
            error = (type(exc).__name__, str(exc))
    seen = [(w.category.__name__, str(w.message)) for w in caught if "averag" in str(w.message)]
    return (*error, seen)


BAD_INPUT: dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]] = {
    "period 0": ("periodic", (0,), {}),
    "negative period": ("periodic", (-3,), {}),
    "negative warmup": ("periodic", (4,), {"warmup_steps": -1}),
    "period 1 warns": ("periodic", (1,), {}),
    "no dict": ("hier", (), {}),
    "empty dict": ("hier", (OrderedDict(),), {}),
    "period 0 level": ("hier", (OrderedDict([(0, 1), (4, 2)]),), {}),
    "max period 1 warns": ("hier", (OrderedDict([(1, 2)]),), {}),
    "last size not world": ("hier", (OrderedDict([(2, 1), (4, 1)]),), {}),
    "size above world": ("hier", (OrderedDict([(2, 3), (4, 2)]),), {}),
    "hier negative warmup": ("hier", (OrderedDict([(2, 2)]),), {"warmup_steps": -2}),
}


def _compare_bad_input(rank: int, world_size: int, case: str) -> list[Any]:
    kind, args, kwargs = BAD_INPUT[case]
    outcomes = []
    for periodic, hier in ((torch_averagers, torch_hier), (our_averagers, our_hier)):
        cls = (
            periodic.PeriodicModelAverager if kind == "periodic" else hier.HierarchicalModelAverager
        )
        outcomes.append(_outcome(lambda: cls(*args, **kwargs)))  # noqa: B023
    return outcomes


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_like_torch(world2: World, case: str) -> None:
    theirs, ours = world2.run(_compare_bad_input, case)[0]
    assert ours == theirs
    assert ours[0] or ours[2], "every case must raise or warn"


def _check_warning_blames_caller(rank: int, world_size: int) -> list[str]:
    files = []
    for make in (
        lambda: our_averagers.PeriodicModelAverager(1),
        lambda: our_hier.HierarchicalModelAverager(OrderedDict([(1, 2)])),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        files += [w.filename for w in caught]
    return files


def test_warnings_point_at_the_caller(world2: World) -> None:
    files = world2.run(_check_warning_blames_caller)[0]
    assert len(files) == 2
    assert all(f == __file__ for f in files), files


def _check_utils_errors(rank: int, world_size: int) -> list[Any]:
    out = []
    for utils in (torch_utils, our_utils):
        p = torch.nn.Parameter(torch.ones(2))
        out.append(_outcome(lambda: utils.get_params_to_average([torch.ones(2)])))  # noqa: B023
        out.append(_outcome(lambda: utils.average_parameters(iter([]), None)))  # noqa: B023
        out.append(_outcome(lambda: utils.average_parameters_or_parameter_groups([p], None)))  # noqa: B023
    return out


def test_utils_errors_like_torch(world2: World) -> None:
    out = world2.run(_check_utils_errors)[0]
    theirs, ours = out[:3], out[3:]
    assert ours[0] == theirs[0]
    # Nothing to average: torch.cat's error; ours says why after torch's words.
    for t, o in zip(theirs[1:], ours[1:]):
        assert o[0] == t[0] == "ValueError"
        assert o[1].startswith(t[1])


def _check_not_a_member(rank: int, world_size: int) -> list[str]:
    only_rank0 = dist.new_group([0])
    makers: list[Callable[[], Any]] = [
        lambda: our_averagers.PeriodicModelAverager(2, process_group=only_rank0),
        lambda: our_hier.HierarchicalModelAverager(OrderedDict([(2, 1)]), 0, only_rank0),
        lambda: our_hook.PostLocalSGDState(only_rank0, None, 2),
        lambda: our_hook.PostLocalSGDState(None, only_rank0, 2),
    ]
    return [":".join(_outcome(make)[:2]) for make in makers]


def test_group_without_this_rank_is_a_clear_error(world2: World) -> None:
    on_member, on_other = world2.run(_check_not_a_member)
    assert on_member == [":"] * 4
    for message in on_other:
        assert message.startswith("ValueError:")
        assert "is not a member" in message


# -- schedule and values: our averagers next to torch's -------------------------------------------


def _make_averager(spec: tuple[Any, ...], ours: bool) -> Any:
    kind, *args = spec
    if kind == "periodic":
        module: Any = our_averagers if ours else torch_averagers
        return module.PeriodicModelAverager(*args)
    cls = our_hier.HierarchicalModelAverager if ours else torch_hier.HierarchicalModelAverager
    return cls(OrderedDict(args[0]), args[1])


def _run_averagers(
    rank: int, world_size: int, torch_spec: tuple[Any, ...], our_spec: tuple[Any, ...], steps: int
) -> list[float]:
    """Drift the replicas apart each step; average with torch's and ours; assert bitwise equal."""
    theirs, ours = (torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)) for _ in "ab")
    ours.load_state_dict(theirs.state_dict())
    ours[1].bias.requires_grad_(False)  # a parameter without grad is never averaged
    theirs[1].bias.requires_grad_(False)
    opt_t = torch.optim.SGD(theirs.parameters(), lr=0.1)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.1)
    averager_t = _make_averager(torch_spec, ours=False)
    averager_o = _make_averager(our_spec, ours=True)
    gen = torch.Generator().manual_seed(rank)
    checksums = []
    for step in range(steps):
        x = torch.randn(3, 5, generator=gen)
        for model, opt in ((theirs, opt_t), (ours, opt_o)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        averager_t.average_parameters(theirs.parameters())
        # Parameter groups input for ours: the same selection as model.parameters().
        averager_o.average_parameters(opt_o.param_groups)
        for p_t, p_o in zip(theirs.parameters(), ours.parameters()):
            assert torch.equal(p_t, p_o), step
        assert averager_o.step == averager_t.step == step + 1
        checksums.append(float(sum(p.double().sum() for p in ours[0].parameters())))
    return checksums


AVERAGERS = {
    "periodic": (("periodic", 3, 2), ("periodic", 3, 2), [2, 5, 8]),
    "hierarchical": (
        ("hier", [(2, 1), (4, 2)], 3),
        ("hier", [(2, 1), (4, 2)], 3),
        [4, 8],
    ),
    "one-level == periodic": (("periodic", 3, 6), ("hier", [(3, 2)], 6), [6, 9]),
}


@pytest.mark.parametrize("name", list(AVERAGERS))
def test_averagers_match_torch(world2: World, name: str) -> None:
    torch_spec, our_spec, averaged = AVERAGERS[name]
    rank0, rank1 = world2.run(_run_averagers, torch_spec, our_spec, 10)
    synced = [a == b for a, b in zip(rank0, rank1)]
    assert [i for i, s in enumerate(synced) if s] == averaged


def _check_state_slots(rank: int, world_size: int) -> list[Any]:
    ours = our_hook.PostLocalSGDState(None, None, 3)
    theirs = torch_hook.PostLocalSGDState(None, None, 3)
    return [sorted(type(ours).__slots__), sorted(type(theirs).__slots__), ours.iter, theirs.iter]


def test_hook_state_attributes_like_torch(world2: World) -> None:
    ours, theirs, it_o, it_t = world2.run(_check_state_slots)[0]
    assert ours == theirs
    assert it_o == it_t == 0
