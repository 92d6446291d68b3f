"""_tree: flatten policy (None is a leaf, namespace), structure checks, tree maths (Hypothesis)."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from functional_optim import _tree

Pair = namedtuple("Pair", ["left", "right"])

shapes = st.sampled_from([(), (0,), (3,), (2, 2)])
tensor_leaves = st.builds(
    lambda shape, seed: torch.randn(shape, generator=torch.Generator().manual_seed(seed)),
    shapes,
    st.integers(0, 1000),
)
leaves = st.one_of(tensor_leaves, st.none())
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
        st.builds(Pair, children, children),
    ),
    max_leaves=8,
)


def tensor_leaves_of(tree: Any) -> list[Tensor]:
    return [x for x in _tree.tree_leaves(tree) if x is not None]


@settings(max_examples=60)
@given(trees)
def test_flatten_round_trip_keeps_none_leaves(tree: Any) -> None:
    leaves, spec = _tree.tree_flatten(tree)
    rebuilt = _tree.tree_unflatten(spec, leaves)
    assert _tree.tree_structure(rebuilt) == spec
    assert all(a is b for a, b in zip(_tree.tree_leaves(rebuilt), leaves, strict=True))
    assert spec.num_leaves == len(leaves)
    assert _tree.leaves_like(spec, tree) == leaves


@settings(max_examples=60)
@given(trees)
def test_tree_maths_leafwise(tree: Any) -> None:
    other = _tree.tree_map(lambda x: None if x is None else x + 1.5, tree)
    added = _tree.tree_add(tree, other)
    subbed = _tree.tree_sub(tree, other)
    scaled = _tree.tree_scale(tree, 3.0)
    zeros = _tree.tree_zeros_like(tree)
    full = _tree.tree_full_like(tree, 2.0)
    clone = _tree.tree_clone(tree)
    for x, a, s, m, z, f, c in zip(
        *(_tree.tree_leaves(t) for t in (tree, added, subbed, scaled, zeros, full, clone)),
        strict=True,
    ):
        if x is None:
            assert a is s is m is z is f is c is None
            continue
        assert torch.equal(a, x + (x + 1.5))
        assert torch.equal(s, x - (x + 1.5))
        assert torch.equal(m, x * 3.0)
        assert torch.equal(z, torch.zeros_like(x))
        assert torch.equal(f, torch.full_like(x, 2.0))
        assert torch.equal(c, x)
        assert c is not x


@settings(max_examples=60)
@given(trees)
def test_global_norm_matches_torch(tree: Any) -> None:
    ts = tensor_leaves_of(tree)
    ours = _tree.tree_global_norm(tree)
    expected = torch.nn.utils.get_total_norm(ts, foreach=False) if ts else torch.tensor(0.0)
    assert torch.equal(ours, expected)


def test_empty_trees() -> None:
    for empty in ([], (), {}, [[], {}]):
        leaves, spec = _tree.tree_flatten(empty)
        assert leaves == []
        assert _tree.tree_unflatten(spec, []) == empty
        assert float(_tree.tree_global_norm(empty)) == 0.0
        assert _tree.tree_zeros_like(empty) == empty


def test_policy_and_structure_errors() -> None:
    assert _tree.NONE_IS_LEAF is True
    assert _tree.NAMESPACE == "functional_optim"
    spec = _tree.tree_structure({"a": torch.ones(1), "b": [torch.ones(1)]})
    # a None gradient keeps the structure
    assert _tree.leaves_like(spec, {"a": None, "b": [torch.ones(1)]})[0] is None
    with pytest.raises(ValueError, match="does not have the structure"):
        _tree.leaves_like(spec, {"a": torch.ones(1)}, "grads")
    with pytest.raises(ValueError, match="second tree"):
        _tree.tree_add([torch.ones(1)], [torch.ones(1), torch.ones(1)])


def test_namespace_registration() -> None:
    import optree

    class Box:
        def __init__(self, a: Tensor, b: Tensor) -> None:
            self.a, self.b = a, b

    optree.register_pytree_node(
        Box,
        lambda box: ((box.a, box.b), None, None),
        lambda _, children: Box(*children),
        namespace=_tree.NAMESPACE,
    )
    box = Box(torch.ones(2), torch.zeros(1))
    leaves, _ = _tree.tree_flatten(box)
    assert len(leaves) == 2
    doubled = _tree.tree_scale(box, 2.0)
    assert isinstance(doubled, Box)
    assert torch.equal(doubled.a, torch.full((2,), 2.0))


class _Node(Tensor):
    """A tensor subclass registered as a pytree node (its child is its plain tensor)."""


def test_flat_list_shortcut_gives_optree_leaves_and_spec() -> None:
    """A list of tensors/Parameters/None skips optree's walk with optree's exact result."""
    optree.register_pytree_node(
        _Node,
        lambda t: ([t.as_subclass(Tensor)], None, None),
        lambda _, children: children[0].as_subclass(_Node),
        namespace=_tree.NAMESPACE,
    )
    try:
        node = torch.ones(2).as_subclass(_Node)
        param = torch.nn.Parameter(torch.ones(2))
        for tree in ([], [torch.ones(1), None, param], [torch.ones(1), node]):
            leaves, spec = _tree.tree_flatten(tree)
            ref_leaves, ref_spec = optree.tree_flatten(
                tree, none_is_leaf=True, namespace=_tree.NAMESPACE
            )
            assert spec == ref_spec
            assert [type(x) for x in leaves] == [type(x) for x in ref_leaves]
            assert all(a is b for a, b in zip(leaves, ref_leaves, strict=True)) or tree[-1] is node
            assert leaves is not tree
    finally:
        optree.unregister_pytree_node(_Node, namespace=_tree.NAMESPACE)
