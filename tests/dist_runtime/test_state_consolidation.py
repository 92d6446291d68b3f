"""dist_runtime.state_consolidation: merge and split (pure); gathering runs in the ZeRO tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_runtime.state_consolidation import (
    copy_to_device,
    merge_local_state_dicts,
    split_global_state,
)


def test_copy_to_device_keeps_structure() -> None:
    value = {"a": [torch.ones(1), (torch.zeros(2), 3)], "b": "x", "c": None}
    copied = copy_to_device(value, torch.device("meta"))
    assert copied["a"][0].device.type == "meta"
    assert isinstance(copied["a"], list)
    assert isinstance(copied["a"][1], tuple)
    assert copied["a"][1][0].device.type == "meta"
    assert copied["a"][1][1] == 3
    assert copied["b"] == "x"
    assert copied["c"] is None
    # Same device: tensors pass through (Tensor.to semantics, as torch's helper).
    same = copy_to_device(value, torch.device("cpu"))
    assert same["a"][0] is value["a"][0]


def _plain_state_dict(num_params: int, groups: list[list[int]]) -> dict[str, Any]:
    """A plain optimizer's state_dict layout: state by global index, groups of indices."""
    return {
        "state": {},
        "param_groups": [{"lr": 0.1 * (g + 1), "params": list(ix)} for g, ix in enumerate(groups)],
    }


def test_merge_places_local_states_under_global_indices() -> None:
    params = [torch.zeros(i + 1) for i in range(5)]
    param_to_index = {p: i for i, p in enumerate(params)}
    # Two groups: [0, 1, 2] and [3, 4]; rank 0 owns 2, 0 | 4; rank 1 owns 1 | 3.
    rank_param_groups = [[[params[2], params[0]], [params[4]]], [[params[1]], [params[3]]]]
    local = [
        {
            "state": {0: {"s": 2}, 2: {"s": 4}},  # local index 1 (param 0) has no state
            "param_groups": [{"params": [0, 1]}, {"params": [2]}],
        },
        {"state": {0: {"s": 1}, 1: {"s": 3}}, "param_groups": [{"params": [0]}, {"params": [1]}]},
    ]
    merged = merge_local_state_dicts(
        _plain_state_dict(5, [[0, 1, 2], [3, 4]]), local, rank_param_groups, param_to_index
    )
    assert list(merged["state"].items()) == [
        (1, {"s": 1}),
        (2, {"s": 2}),
        (3, {"s": 3}),
        (4, {"s": 4}),
    ]
    assert merged["param_groups"][1]["params"] == [3, 4]


def test_merge_rejects_mismatched_layouts() -> None:
    params = [torch.zeros(1), torch.zeros(1)]
    index = {p: i for i, p in enumerate(params)}
    local = [{"state": {}, "param_groups": [{"params": [0]}]}]
    with pytest.raises(AssertionError, match="number of local and global parameter groups"):
        merge_local_state_dicts(_plain_state_dict(2, [[0, 1]]), local, [[[params[0]], []]], index)
    with pytest.raises(AssertionError, match="parameters in parameter group"):
        merge_local_state_dicts(_plain_state_dict(2, [[0, 1]]), local, [[params]], index)


def test_split_keeps_owned_state_and_blanks_the_rest() -> None:
    params = [torch.zeros(1) for _ in range(3)]
    owners = {params[0]: 1, params[1]: 0, params[2]: 1}
    state = {0: {"m": 0}, 2: {"m": 2}, 1: {"m": 1}}
    local, kept = split_global_state(state, params, owners, rank=1)
    assert local == {params[0]: {"m": 0}, params[2]: {"m": 2}}
    assert kept == {0: {"m": 0}, 2: {"m": 2}, 1: None}
    assert state == {0: {"m": 0}, 2: {"m": 2}, 1: {"m": 1}}  # input untouched


def test_split_rejects_unknown_indices() -> None:
    params = [torch.zeros(1)]
    with pytest.raises(IndexError, match="only 1 parameters"):
        split_global_state({1: {}}, params, {params[0]: 0}, rank=0)
