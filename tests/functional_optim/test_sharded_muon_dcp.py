"""fo.muon's state (the momentum) on FSDP2 saves through DCP and resumes at another world size.

A model of 2-D params of shapes that split unevenly (7 x 5, 33 x 9, 16 x 24, and 2 x 3: an
empty shard at 3 ranks) trains ``SAVED_AFTER`` steps on 2 gloo ranks (FSDP2,
``fo.Optimizer(fo.muon)``); the model and optimizer are saved with
``get_model_state_dict``/``get_optimizer_state_dict`` + ``dcp.save`` (nested and flattened
optimizer state dicts), then loaded into fresh models and optimizers (other initial weights)
with ``dcp.load`` + ``set_model_state_dict``/``set_optimizer_state_dict``, at 3 ranks (FSDP2,
fo.muon) and in this process (no FSDP: ``fo.Optimizer(fo.muon)`` and ``torch.optim.Muon``),
and trained ``RESUMED_FOR`` more steps (the fresh optimizers are built with another lr: the
loaded param groups must replace it). Reference: one uninterrupted ``torch.optim.Muon`` run on
the unsharded model with the same gradients (every rank makes the full gradient from a seed
and keeps its rows). Tolerance: bitwise, for the params, the loaded momentum and the momentum
read straight from the checkpoint files: the momentum is element-wise on any row split, and
Newton-Schulz runs on the bf16 cast of the same full direction on whichever rank owns it.
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
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import functional_optim as fo
from tests._world import World

SHAPES = {"a": [(7, 5), (33, 9)], "b": [(16, 24), (2, 3)]}
NAMES = [f"{block}.w{i}" for block, shapes in SHAPES.items() for i in range(len(shapes))]
MUON: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True}
MUON["adjust_lr_fn"] = "match_rms_adamw"
SAVED_AFTER = 3
RESUMED_FOR = 3
FLATTEN = (False, True)

pytestmark = pytest.mark.distributed


class _Block(nn.Module):
    def __init__(self, shapes: list[tuple[int, int]], gen: torch.Generator) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"w{i}", nn.Parameter(torch.randn(shape, generator=gen)))


class _Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a = _Block(SHAPES["a"], gen)
        self.b = _Block(SHAPES["b"], gen)


def _set_grads(model: nn.Module, step: int) -> None:
    """The same full gradients everywhere; a DTensor param gets its own rows (no comms)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        if isinstance(p, DTensor):
            grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = grad


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        _set_grads(model, step)
        optim.step()
        optim.zero_grad(set_to_none=True)


def _reference(steps: int) -> tuple[_Net, torch.optim.Muon]:
    """Uninterrupted single-process torch.optim.Muon after ``steps`` steps."""
    model = _Net()
    optim = torch.optim.Muon(model.parameters(), **MUON)
    _train(model, optim, range(steps))
    return model, optim


def _sharded(model: _Net) -> _Net:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    return model


def _full(value: Any) -> torch.Tensor:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return full.detach()  # type: ignore[no-any-return]


def _momenta(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Whole momentum buffers by parameter name (collective for DTensor state)."""
    osd = get_optimizer_state_dict(model, optim)
    return {fqn: _full(state["momentum_buffer"]) for fqn, state in osd["state"].items()}


def _diffs(
    model: nn.Module, optim: torch.optim.Optimizer, want: tuple[_Net, torch.optim.Muon], label: str
) -> list[str]:
    """What differs (bitwise) from the reference's params and momentum buffers."""
    ref_model, ref_optim = want
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if not torch.equal(_full(p), q.detach()):
            bad.append(f"{label}: param {name} differs by {(_full(p) - q).abs().max():.1e}")
    ours, theirs = _momenta(model, optim), _momenta(ref_model, ref_optim)
    if sorted(ours) != sorted(theirs) or sorted(ours) != sorted(NAMES):
        return [*bad, f"{label}: momentum for {sorted(ours)}, torch has {sorted(theirs)}"]
    bad += [f"{label}: momentum of {n}" for n in NAMES if not torch.equal(ours[n], theirs[n])]
    return bad


def _local_rows(model: nn.Module) -> list[int]:
    return [int(p.to_local().shape[0]) for p in model.parameters()]


def _options(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _save(rank: int, world_size: int, root: str) -> list[str]:
    """Train on FSDP2, save (nested and flattened), train on; what differs from torch."""
    model = _sharded(_Net())
    optim = fo.Optimizer(model.parameters(), fo.muon(**MUON))
    assert _local_rows(model) == [[4, 17, 8, 1], [3, 16, 8, 1]][rank]  # uneven splits
    _train(model, optim, range(SAVED_AFTER))
    bad = _diffs(model, optim, _reference(SAVED_AFTER), "saved")
    for flatten in FLATTEN:
        osd = get_optimizer_state_dict(model, optim, options=_options(flatten))
        state = {"model": get_model_state_dict(model), "optim": osd}
        dcp.save(state, checkpoint_id=f"{root}/flatten={flatten}")
    _train(model, optim, range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR))
    return bad + _diffs(model, optim, _reference(SAVED_AFTER + RESUMED_FOR), "live")


def _load(rank: int, world_size: int, root: str, flatten: bool, kind: str) -> list[str]:
    """Load a checkpoint into a fresh model (other weights) and optimizer, check it, resume.

    ``world_size`` 1: no FSDP (this process, no process group); else FSDP2 on the world.
    ``kind``: ``fo`` (``fo.Optimizer(fo.muon)``) or ``torch`` (``torch.optim.Muon``).
    """
    model = _Net(seed=1) if world_size == 1 else _sharded(_Net(seed=1))
    if world_size == 3:
        assert _local_rows(model) == [[3, 11, 6, 1], [3, 11, 6, 1], [1, 11, 4, 0]][rank]
    fresh = {**MUON, "lr": 0.5}  # the saved param groups must replace these
    optim: torch.optim.Optimizer
    if kind == "fo":
        optim = fo.Optimizer(model.parameters(), fo.muon(**fresh))
    else:
        optim = torch.optim.Muon(model.parameters(), **fresh)
    osd = get_optimizer_state_dict(model, optim, options=_options(flatten))
    state = {"model": get_model_state_dict(model), "optim": osd}
    with warnings.catch_warnings():
        if world_size == 1:  # dcp says it loads in one process, as meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=f"{root}/flatten={flatten}")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"], options=_options(flatten))
    label = f"{kind} at {world_size} rank(s), flatten={flatten}"
    bad = _diffs(model, optim, _reference(SAVED_AFTER), f"{label}, loaded")
    if optim.param_groups[0]["lr"] != MUON["lr"]:
        bad.append(f"{label}, loaded: lr {optim.param_groups[0]['lr']}")
    _train(model, optim, range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR))
    return bad + _diffs(model, optim, _reference(SAVED_AFTER + RESUMED_FOR), f"{label}, resumed")


@pytest.fixture(scope="module")
def checkpoints(world2: World, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checkpoints of the 2-rank FSDP2 run (which matched torch before and after them)."""
    root = str(tmp_path_factory.mktemp("muon_dcp"))
    assert world2.run(_save, root) == [[], []]
    return root


def test_checkpoint_files_hold_torchs_momentum(checkpoints: str, tmp_path: Path) -> None:
    """The momentum as written (read back without any model or optimizer) is torch's at that
    step, and so are the weights."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref_model, ref_optim = _reference(SAVED_AFTER)
    weights = dict(ref_model.named_parameters())
    momenta = _momenta(ref_model, ref_optim)
    for flatten in FLATTEN:
        target = tmp_path / f"flatten={flatten}.pt"
        dcp_to_torch_save(f"{checkpoints}/flatten={flatten}", target)
        saved = torch.load(target, weights_only=True)
        for name in NAMES:
            if flatten:
                buf = saved["optim"][f"state.{name}.momentum_buffer"]
            else:
                buf = saved["optim"]["state"][name]["momentum_buffer"]
            assert torch.equal(buf, momenta[name]), (flatten, name)
            assert torch.equal(saved["model"][name], weights[name].detach()), (flatten, name)
        assert momenta[NAMES[0]].abs().sum() > 0  # not a trivial (zero) momentum


@pytest.mark.parametrize("flatten", FLATTEN)
def test_resume_at_3_ranks_fsdp2_bitwise(world3: World, checkpoints: str, flatten: bool) -> None:
    assert world3.run(_load, checkpoints, flatten, "fo") == [[], [], []]


@pytest.mark.parametrize("kind", ["fo", "torch"])
@pytest.mark.parametrize("flatten", FLATTEN)
def test_resume_in_one_process_bitwise(checkpoints: str, flatten: bool, kind: str) -> None:
    assert _load(0, 1, checkpoints, flatten, kind) == []


def test_a_stale_momentum_is_caught(tmp_path: Path) -> None:
    """The checks can fail: a checkpoint with the right weights but torch's momentum of one
    step earlier is reported as loaded wrong and resumed wrong."""
    model, _ = _reference(SAVED_AFTER)
    stale_model, stale_optim = _reference(SAVED_AFTER - 1)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(stale_model, stale_optim),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=f"{tmp_path}/flatten=False")
    for kind in ("fo", "torch"):
        bad = _load(0, 1, str(tmp_path), False, kind)
        assert not any("param" in line for line in bad if "loaded" in line), bad
        assert f"{kind} at 1 rank(s), flatten=False, loaded: momentum of a.w0" in bad
        assert any("resumed: param a.w0 differs" in line for line in bad), bad
