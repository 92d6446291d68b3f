"""DCP optimizer state: the block layout of cut parameters (pure), and ``fo.Optimizer`` under
torch's DSD API (get/set_optimizer_state_dict + dcp.save/load) on a DDP and an FSDP2 model.

Resume checks save at one world size and load at another (2 -> 3 and 3 -> 2 ranks, gloo, CPU),
nested and flattened state dicts, and compare the parameters after more steps with an
uninterrupted single-process run of the same optimizer on the same gradients (every rank gets
the same ones; FSDP2's shards are elementwise slices): bitwise. ``torch.optim.AdamW`` runs the
same checks as the control.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import functional_optim as fo
from dist_runtime.dcp_optimizer_state import (
    _block_indices,
    _from_sharded,
    piece_values,
    row_major_blocks,
)
from dist_runtime.piece_state import Piece
from tests._world import World

SAVED_AFTER = 3
RESUMED_FOR = 2
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "fo": lambda groups: fo.Optimizer(groups, fo.adamw(lr=0.01, weight_decay=0.1, amsgrad=True)),
    "torch": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1, amsgrad=True),
}
WRAPPERS = ("ddp", "fsdp2")


# -- the block layout (pure) ------------------------------------------------------------------


@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_row_major_blocks_tile_the_range(shape: list[int], data: Any) -> None:
    numel = int(torch.tensor(shape).prod())
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    blocks = row_major_blocks(shape, start, stop)
    index = torch.arange(numel).reshape(shape)
    position = start
    for block in blocks:
        where = tuple(slice(o, o + s) for o, s in zip(block.offsets, block.sizes))
        covered = index[where].reshape(-1)
        # contiguous, in order, starting where the previous block stopped
        assert covered.tolist() == list(range(position, position + block.numel))
        assert block.start == position
        assert block.numel > 0
        position += block.numel
    assert position == stop
    assert len(blocks) <= 2 * len(shape) - 1


@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
def test_block_indices_are_the_row_major_elements(shape: list[int], data: Any) -> None:
    offsets = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets)]
    want = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    want = want[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
    got = _block_indices(offsets, sizes, shape)
    if isinstance(got, slice):
        got = torch.arange(got.start, got.stop)
    assert torch.equal(got, want)


class _FakeSharded:
    """What ``_from_sharded`` reads of a ShardedTensor: its size and local shards."""

    def __init__(self, full: torch.Tensor, blocks: list[tuple[list[int], list[int]]]) -> None:
        self.full = full
        self.blocks = blocks

    def size(self) -> torch.Size:
        return self.full.shape

    def local_shards(self) -> list[Any]:
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor.shard import Shard

        return [
            Shard(
                self.full[tuple(slice(o, o + n) for o, n in zip(offs, sizes))].clone(),
                ShardMetadata(offs, sizes, "rank:0/cpu"),
            )
            for offs, sizes in self.blocks
        ]


def test_pieces_from_column_blocks() -> None:
    """Shards that are not runs of elements (column blocks) still give any covered piece."""
    full = torch.arange(24.0).reshape(4, 6)
    halves = _FakeSharded(full, [([0, 0], [2, 3]), ([0, 3], [2, 3])])  # rows 0-1
    got = _from_sharded("exp_avg", halves, Piece(0, 2, 10, (4, 6)))  # type: ignore[arg-type]
    assert torch.equal(got, torch.arange(2.0, 10.0))
    with pytest.raises(ValueError, match="do not cover"):
        _from_sharded("exp_avg", halves, Piece(0, 10, 14, (4, 6)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has shape"):
        _from_sharded("exp_avg", halves, Piece(0, 0, 4, (6, 4)))  # type: ignore[arg-type]


def test_piece_values_cuts_whole_state() -> None:
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(12.0).reshape(3, 4)}
    got = piece_values(state, Piece(0, 5, 9, (3, 4)))
    assert got["step"] is state["step"]
    assert torch.equal(got["exp_avg"], torch.arange(5.0, 9.0))
    assert piece_values(state, Piece(0, 0, 12, (3, 4)))["exp_avg"].shape == (3, 4)


# -- fo.Optimizer on DDP and FSDP2 models -----------------------------------------------------


@pytest.fixture(scope="module")
def world2() -> Any:
    with World(2) as world:
        yield world


@pytest.fixture(scope="module")
def world3() -> Any:
    with World(3) as world:
        yield world


class _Block(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]], gen: torch.Generator) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            value = torch.randn(shape, generator=gen, dtype=torch.float64)
            self.register_parameter(f"w{i}", nn.Parameter(value))


class _Net(nn.Module):
    """Dim 0 of 7, 13, 2, 40 and 3 rows: uneven FSDP2 shards, an empty one at 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = _Block([(7, 5), (13,)], gen)
        self.b = _Block([(2, 9), (40,), (3, 4, 2)], gen)


def _groups(model: nn.Module, lr2: float = 0.003) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": lr2}]


def _set_grads(model: nn.Module, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, p in enumerate(model.parameters()):
        gen = torch.Generator().manual_seed(100 * step + i)
        grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if isinstance(p, DTensor):  # this rank's rows, no communication
            grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None)
        p.grad = grad


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        _set_grads(model, step)
        optim.step()
        optim.zero_grad(set_to_none=True)


def _reference(name: str, steps: int) -> _Net:
    model = _Net()
    _train(model, OPTIMIZERS[name](_groups(model)), range(steps))
    return model


def _wrapped(wrapper: str, start: nn.Module | None = None) -> nn.Module:
    net = _Net()
    if start is not None:
        with torch.no_grad():
            for p, q in zip(net.parameters(), start.parameters()):
                p.copy_(q)
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    from torch.distributed.fsdp import fully_shard

    fully_shard(net.a)
    fully_shard(net.b)
    fully_shard(net)
    return net


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _mismatches(model: nn.Module, want: nn.Module, rtol: float = 0.0) -> list[str]:
    """Names of the parameters that differ from ``want`` (bitwise, or beyond ``rtol``)."""
    bad = []
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        full = _full(p).detach()
        same = torch.equal(full, q) if rtol == 0 else torch.allclose(full, q, rtol=rtol, atol=0)
        if not same:
            bad.append(f"{name} (max diff {(full - q).abs().max().item():.1e})")
    return bad


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole optimizer state (collective for DTensor state), by parameter name."""
    osd = get_optimizer_state_dict(model, optim)
    return {
        fqn: {k: _full(v).clone() for k, v in state.items()} for fqn, state in osd["state"].items()
    }


def _rtol(name: str, wrapper: str) -> float:
    # fo.adamw runs torch's fused CPU kernel, which rounds the elements of its scalar tail
    # (past the last full vector) differently from the vectorised ones; on FSDP2 the kernel sees
    # each rank's shard, so other elements fall in the tail than in the unsharded reference and
    # some differ by an ulp (torch.optim.AdamW(fused=True) on FSDP2 does the same; the "torch"
    # rows here use torch's default foreach kernel, which does not depend on the split).
    return 1e-13 if (name, wrapper) == ("fo", "fsdp2") else 0.0


def _options(flatten: bool) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=flatten)


def _save_all(rank: int, world_size: int, root: str) -> tuple[list[str], dict[str, Any]]:
    """Train, save through DSD, train on; returns errors and the whole saved states."""
    errors = []
    saved = {}
    for name in OPTIMIZERS:
        want = _reference(name, SAVED_AFTER + RESUMED_FOR)
        for wrapper in WRAPPERS:
            for flatten in (False, True):
                label = f"{name}-{wrapper}-{flatten}"
                model = _wrapped(wrapper)
                optim = OPTIMIZERS[name](_groups(model))
                _train(model, optim, range(SAVED_AFTER))
                osd = get_optimizer_state_dict(model, optim, options=_options(flatten))
                dcp.save({"optim": osd}, checkpoint_id=f"{root}/{label}")
                saved[label] = _full_state(model, optim)
                _train(model, optim, range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR))
                bad = _mismatches(model, want, _rtol(name, wrapper))
                if bad:
                    errors.append(f"save {label}: the live run differs at {bad}")
    return errors, saved if rank == 0 else {}


def _load_all(rank: int, world_size: int, root: str, saved: dict[str, Any]) -> list[str]:
    """Load each checkpoint into a fresh model and optimizer, compare the state, resume."""
    errors = []
    for name in OPTIMIZERS:
        at_save = _reference(name, SAVED_AFTER)
        want = _reference(name, SAVED_AFTER + RESUMED_FOR)
        for wrapper in WRAPPERS:
            for flatten in (False, True):
                label = f"{name}-{wrapper}-{flatten}"
                model = _wrapped(wrapper, at_save)
                optim = OPTIMIZERS[name](_groups(model, lr2=0.5))
                try:
                    osd = get_optimizer_state_dict(model, optim, options=_options(flatten))
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)
                        dcp.load({"optim": osd}, checkpoint_id=f"{root}/{name}-{wrapper}-{flatten}")
                    set_optimizer_state_dict(model, optim, osd, options=_options(flatten))
                except Exception as error:  # reported with the control's outcome
                    errors.append(f"{label}: {type(error).__name__}: {error}")
                    continue
                if optim.param_groups[1]["lr"] != 0.003:
                    errors.append(f"{label}: lr not loaded")
                state = _full_state(model, optim)
                if state.keys() != saved[label].keys() or any(
                    state[fqn].keys() != values.keys()
                    or not all(torch.equal(state[fqn][k], v) for k, v in values.items())
                    for fqn, values in saved[label].items()
                ):
                    errors.append(f"{label}: the loaded state is not the saved one")
                _train(model, optim, range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR))
                bad = _mismatches(model, want, _rtol(name, wrapper))
                if bad:
                    errors.append(f"{label}: resumed params differ at {bad}")
    return errors


@pytest.mark.distributed
def test_save_2_ranks_load_3_ranks(world2: World, world3: World, tmp_path: Path) -> None:
    saved = world2.run(_save_all, str(tmp_path))
    assert [errors for errors, _ in saved] == [[], []]
    assert world3.run(_load_all, str(tmp_path), saved[0][1]) == [[], [], []]


@pytest.mark.distributed
def test_save_3_ranks_load_2_ranks(world2: World, world3: World, tmp_path: Path) -> None:
    saved = world3.run(_save_all, str(tmp_path))
    assert [errors for errors, _ in saved] == [[], [], []]
    assert world2.run(_load_all, str(tmp_path), saved[0][1]) == [[], []]
