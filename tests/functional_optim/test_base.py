"""_base: GradientTransformation contract, chain, identity, apply_updates."""

from __future__ import annotations

import pytest
import torch

import functional_optim as fo


def test_chain_applies_in_order_and_keeps_component_states() -> None:
    params = {"w": torch.ones(3)}
    tx = fo.chain(fo.add_decayed_weights(0.5), fo.scale(2.0), fo.identity())
    state = tx.init(params)
    assert state == (fo.EmptyState(), fo.EmptyState(), fo.EmptyState())
    updates, state2 = tx.update({"w": torch.full((3,), 4.0)}, state, params)
    assert torch.equal(updates["w"], torch.full((3,), 9.0))  # (4 + 0.5 * 1) * 2
    assert state2 == state
    assert tx.step is not None  # every component has list maths: chain builds an in-place step
    no_lists = fo.add_noise(0.01, 0.55, 0)._replace(lists=None)
    assert fo.chain(fo.scale(2.0), no_lists).step is None  # a component without list maths


def test_chain_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="call the factory"):
        fo.chain(fo.scale_by_adam)  # type: ignore[arg-type]
    tx = fo.chain(fo.scale(1.0))
    with pytest.raises(ValueError, match="state of length"):
        tx.update([torch.ones(1)], (), None)


def test_identity_and_empty_chain() -> None:
    g = [torch.ones(2)]
    for tx in (fo.identity(), fo.chain()):
        updates, _ = tx.update(g, tx.init(g))
        assert updates is g


def test_apply_updates_pure_inplace_and_none() -> None:
    params = {"a": torch.ones(2), "b": torch.zeros(2), "c": None}
    updates = {"a": torch.full((2,), 0.5), "b": None, "c": None}
    new = fo.apply_updates(params, updates)
    assert torch.equal(new["a"], torch.full((2,), 1.5))
    assert new["b"] is params["b"]
    assert torch.equal(params["a"], torch.ones(2)), "pure apply_updates mutated its input"
    a = params["a"]
    same = fo.apply_updates(params, updates, inplace=True)
    assert same is params
    assert same["a"] is a
    assert torch.equal(a, torch.full((2,), 1.5))
    with pytest.raises(ValueError, match="structure"):
        fo.apply_updates(params, {"a": None})


def test_step_field_is_optional_third_field() -> None:
    tx = fo.GradientTransformation(fo.identity().init, fo.identity().update)
    assert tx.step is None
    assert fo.adam().step is not None
    assert fo.chain(tx).step is None
