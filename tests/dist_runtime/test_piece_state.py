"""dist_runtime.piece_state: cutting torch-format state into pieces and joining it back."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dist_runtime.piece_state import Piece, PieceJoiner, join_piece_states, split_param_state


def _state(shape: tuple[int, ...], seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "step": torch.tensor(float(seed + 1)),
        "exp_avg": torch.randn(shape, generator=gen),
        "exp_avg_sq": torch.rand(shape, generator=gen, dtype=torch.float64),
    }


@st.composite
def _cut_parameters(draw: st.DrawFn) -> list[tuple[tuple[int, ...], list[int]]]:
    """Parameters (shapes) and the cut points that split each into pieces."""
    out = []
    for _ in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        numel = 1
        for size in shape:
            numel *= size
        cuts = sorted(draw(st.sets(st.integers(1, numel - 1), max_size=3))) if numel > 1 else []
        out.append((shape, [0, *cuts, numel]))
    return out


@given(_cut_parameters(), st.randoms(use_true_random=False))
def test_split_then_join_in_any_order_is_the_original(
    params: list[tuple[tuple[int, ...], list[int]]], rng: random.Random
) -> None:
    originals = {index: _state(shape, index) for index, (shape, _) in enumerate(params)}
    pieces = [
        (Piece(index, start, stop, shape), split_param_state(originals[index], shape, start, stop))
        for index, (shape, bounds) in enumerate(params)
        for start, stop in itertools.pairwise(bounds)
    ]
    rng.shuffle(pieces)
    joiner = PieceJoiner()
    for piece, state in pieces:
        joiner.add(piece, state)
    joined = joiner.finish()
    assert list(joined) == sorted(originals)
    for index, want in originals.items():
        assert list(joined[index]) == list(want)
        for name, value in want.items():
            assert joined[index][name].dtype == value.dtype
            assert torch.equal(joined[index][name], value), (index, name)


def test_scalars_come_from_the_first_piece_and_pieces_are_copied() -> None:
    shape = (6,)
    state = _state(shape, 0)
    low = split_param_state(state, shape, 0, 2)
    high = split_param_state(state, shape, 2, 6)
    high["step"] = torch.tensor(99.0)
    joiner = PieceJoiner()
    joiner.add(Piece(0, 2, 6, shape), high)
    joiner.add(Piece(0, 0, 2, shape), low)
    high["exp_avg"].fill_(7.0)  # the joined buffer holds its own copy
    joined = joiner.finish()[0]
    assert joined["step"] == state["step"]
    assert torch.equal(joined["exp_avg"], state["exp_avg"])


def test_join_piece_states_matches_the_joiner() -> None:
    shape = (3, 2)
    state = _state(shape, 1)
    bounds = ((3, 6), (0, 3))
    parts = [(start, stop, split_param_state(state, shape, start, stop)) for start, stop in bounds]
    joined = join_piece_states(parts, shape)
    assert all(torch.equal(joined[name], state[name]) for name in state)


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ([(0, 2), (3, 6)], "gap or overlap at element 2"),
        ([(0, 4), (3, 6)], "gap or overlap at element 4"),
        ([(0, 4)], "cover 4 of the parameter's 6 elements"),
        ([], "cover 0 of the parameter's 6 elements"),
    ],
)
def test_pieces_that_do_not_tile_are_rejected(bounds: list[tuple[int, int]], message: str) -> None:
    shape = (6,)
    state = _state(shape, 2)
    parts = [(start, stop, split_param_state(state, shape, start, stop)) for start, stop in bounds]
    with pytest.raises(ValueError, match=message):
        join_piece_states(parts, shape)


def test_pieces_with_different_state_names_are_rejected() -> None:
    shape = (4,)
    state = _state(shape, 3)
    joiner = PieceJoiner()
    joiner.add(Piece(0, 0, 2, shape), split_param_state(state, shape, 0, 2))
    other = split_param_state(state, shape, 2, 4)
    del other["exp_avg_sq"]
    with pytest.raises(ValueError, match="different state names"):
        joiner.add(Piece(0, 2, 4, shape), other)
