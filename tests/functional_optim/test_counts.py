"""Packed step counters (_counts): one add for a block of views, the numbers of the per-leaf
counters, and no sharing that leaks into copies, pure updates or saved state."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim._counts import (
    copied_counts,
    increment_counts,
    repacked_like,
    zero_counts,
)
from functional_optim._tree import tree_leaves

from ._parity import assert_tensors_equal, clone_tensors, make_grads, make_params

LR, WD = 0.05, 0.1

#: Chains whose in-place step increments counters on the list path, by fusion rule.
COUNTED_CHAINS: dict[str, Callable[[], fo.GradientTransformation]] = {
    "lion": lambda: fo.chain(
        fo.scale_by_lion(), fo.add_decayed_weights(WD), fo.scale_by_learning_rate(LR)
    ),
    "rms": lambda: fo.chain(fo.scale_by_rms(), fo.scale_by_learning_rate(LR)),
    "adamax": lambda: fo.chain(fo.scale_by_adamax(), fo.scale(-LR)),
    "adam_head": lambda: fo.chain(fo.scale_by_adam(), fo.scale_by_sign(), fo.scale(-LR)),
    "adagrad_rprop": lambda: fo.chain(fo.scale_by_adagrad(), fo.scale_by_rprop(LR), fo.scale(-1.0)),
}


@pytest.fixture
def count_adds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the length of every ``torch._foreach_add_`` over 0-d tensors (a per-leaf add)."""
    calls: list[int] = []
    original = torch._foreach_add_

    def spy(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if tensors and all(isinstance(t, Tensor) and t.ndim == 0 for t in tensors):
            calls.append(len(tensors))
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", spy)
    return calls


def unpacked(counts: list[Tensor]) -> list[Tensor]:
    return [c.clone() for c in counts]


def test_zero_counts_are_0d_views_of_one_buffer_per_device() -> None:
    params = [torch.ones(2), None, torch.ones(3, dtype=torch.float64), torch.ones(())]
    counts = zero_counts(params)
    assert counts[1] is None
    present = [c for c in counts if c is not None]
    for c in present:
        assert (c.shape, c.dtype, c.device) == ((), torch.float32, params[0].device)
        assert float(c) == 0.0
    assert all(c._base is present[0]._base for c in present)
    torch.set_default_dtype(torch.float64)
    try:
        assert zero_counts([torch.ones(1)])[0].dtype == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_increment_adds_one_to_each_counter_of_a_block_in_one_op(count_adds: list[int]) -> None:
    counts = zero_counts([torch.ones(1)] * 5)
    counts[2].add_(4)  # diverged values: still one add, each +1
    increment_counts(counts)
    assert [float(c) for c in counts] == [1, 1, 5, 1, 1]
    assert count_adds == []


@pytest.mark.parametrize(
    "pick",
    [
        lambda cs: cs[::2],  # a scattered subset (masked leaves, leaves without a gradient)
        lambda cs: cs[::-1],  # another order
        lambda cs: [*cs[:4], cs[0]],  # a counter twice
        unpacked,  # copies
        lambda cs: [*cs[:2], *zero_counts([torch.ones(1)] * 3)],  # two blocks
    ],
    ids=["subset", "reversed", "duplicate", "copies", "two_blocks"],
)
def test_increment_of_anything_but_one_whole_block_is_foreach(
    pick: Callable[[list[Tensor]], list[Tensor]], count_adds: list[int]
) -> None:
    counts = zero_counts([torch.ones(1)] * 5)
    chosen = pick(counts)
    expected = [float(sum(x is c for x in chosen)) for c in chosen]  # a duplicate: twice
    count_adds.clear()
    increment_counts(chosen)
    assert count_adds == [len(chosen)]
    assert [float(c) for c in chosen] == expected


def test_a_deepcopy_is_not_the_original_block(count_adds: list[int]) -> None:
    counts = zero_counts([torch.ones(1)] * 4)
    twin = copy.deepcopy(counts)
    increment_counts(twin)
    assert count_adds == [4]
    assert [float(c) for c in counts] == [0.0] * 4
    assert [float(c) for c in twin] == [1.0] * 4


@pytest.mark.parametrize("name", sorted(COUNTED_CHAINS))
def test_step_on_packed_counters_equals_step_on_per_leaf_counters(
    name: str, count_adds: list[int]
) -> None:
    """The fast increment gives the numbers of the per-leaf counters, bitwise, and is taken."""
    tx = COUNTED_CHAINS[name]()
    assert tx.step is not None
    params = make_params(dtype=torch.float64)
    grads = make_grads(params, 4)
    packed_p, packed = clone_tensors(params), tx.init(params)
    loose_p = clone_tensors(params)
    loose = fo.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, tx.init(params))
    for row in grads:
        packed = tx.step(packed_p, clone_tensors(row), packed)
        count_adds.clear()
        loose = tx.step(loose_p, clone_tensors(row), loose)
        assert count_adds, "the per-leaf counters were not incremented one by one"
    assert_tensors_equal(packed_p, loose_p)
    assert_tensors_equal(
        [x for x in tree_leaves(packed) if isinstance(x, Tensor)],
        [x for x in tree_leaves(loose) if isinstance(x, Tensor)],
    )
    count_adds.clear()
    tx.step(packed_p, clone_tensors(grads[0]), packed)
    assert count_adds == [], "the packed counters took the per-leaf path"


def test_pure_updates_leave_the_callers_counters_and_buffer_alone() -> None:
    tx = COUNTED_CHAINS["lion"]()
    params = make_params()
    state = tx.init(params)
    base = state[0].count[0]._base
    for slow in (False, True):  # the list pure path, then the per-leaf (autograd) path
        ps = [p.clone().requires_grad_(slow) for p in params]
        _, new_state = tx.update(make_grads(params, 1)[0], state, ps)
        assert torch.equal(base, torch.zeros_like(base))
        new_counts = new_state[0].count
        assert [float(c) for c in new_counts] == [1.0] * len(params)
        assert all(c.untyped_storage().data_ptr() != base.data_ptr() for c in new_counts)


def test_torch_func_through_a_packed_state_matches_per_leaf_counters() -> None:
    """grad and vmap take the per-leaf path: packed counters give the numbers of loose ones
    and are not written to."""
    tx = fo.chain(fo.scale_by_adam(), fo.scale(-LR))
    params = make_params(dtype=torch.float64)
    packed = tx.init(params)
    packed = tx.step(clone_tensors(params), make_grads(params, 1)[0], packed)  # counts at 1
    loose = fo.tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, packed)
    before = [x.clone() for x in tree_leaves(packed) if isinstance(x, Tensor)]

    def loss(ps: list[Tensor], state: Any) -> Tensor:
        updates, _ = tx.update([p * p for p in ps], state, ps)
        return torch.stack([(u * p).sum() for u, p in zip(updates, ps, strict=True)]).sum()

    assert_tensors_equal(
        torch.func.grad(loss)(params, packed), torch.func.grad(loss)(params, loose)
    )
    batch = [torch.stack([g, 2 * g]) for g in make_grads(params, 1, seed=5)[0]]

    def batched(state: Any) -> list[Tensor]:
        return torch.func.vmap(lambda gs: tx.update(gs, state, params)[0])(batch)  # type: ignore[no-any-return]

    assert_tensors_equal(batched(packed), batched(loose))
    assert_tensors_equal([x for x in tree_leaves(packed) if isinstance(x, Tensor)], before)


def test_state_dict_counters_are_standalone_and_load_packed(count_adds: list[int]) -> None:
    tx = COUNTED_CHAINS["lion"]
    params = make_params()
    grads = make_grads(params, 3)
    leaves = [p.clone() for p in params]
    opt = fo.Optimizer(leaves, tx())
    for row in grads[:2]:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = g
        opt.step()
    saved = opt.state_dict()
    steps = [entry["count"] for entry in saved["state"].values()]
    assert all(s._base is None and s.untyped_storage().nbytes() == s.element_size() for s in steps)
    restored_leaves = [leaf.detach().clone() for leaf in leaves]
    restored = fo.Optimizer(restored_leaves, tx())
    restored.load_state_dict(pickle.loads(pickle.dumps(saved)))
    counts = restored.transform_states[0][0].count
    assert [float(c) for c in counts] == [2.0] * len(params)
    assert all(c._base is counts[0]._base for c in counts)
    for opt_, ls in ((opt, leaves), (restored, restored_leaves)):
        for leaf, g in zip(ls, grads[2], strict=True):
            leaf.grad = g
        count_adds.clear()
        opt_.step()
        assert count_adds == []
    assert_tensors_equal(restored_leaves, leaves)


def test_repacked_like_keeps_positions_and_casts() -> None:
    template = zero_counts([torch.ones(1), None, torch.ones(1)])
    values = [torch.tensor(3.0, dtype=torch.float64), None, torch.tensor([5.0])]
    out = repacked_like(template, values)
    assert out[1] is None
    assert out[0]._base is not None
    assert out[0]._base is out[2]._base
    assert (out[0].dtype, float(out[0]), out[2].shape, float(out[2])) == (torch.float32, 3, (), 5)
    assert [float(c) for c in template if c is not None] == [0.0, 0.0]
    loose = [torch.tensor(1.0), torch.tensor(2.0)]
    assert repacked_like(unpacked(zero_counts([torch.ones(1)] * 2)), loose) == loose


def test_copied_counts_are_a_new_block_and_a_run_of_a_block_takes_one_add(
    count_adds: list[int],
) -> None:
    """pure_step's copies of packed counters are packed too; a kernel given a chunk of them
    (consecutive views of one block, in order) adds 1 to that slice of the block only."""
    counts = zero_counts([torch.zeros(2), torch.zeros(3), torch.zeros(1), torch.zeros(4)])
    new = copied_counts(counts)
    assert new[0]._base is not None
    assert new[0]._base is new[3]._base
    assert new[0]._base is not counts[0]._base
    increment_counts(new[1:3])
    assert count_adds == []
    assert [float(c) for c in new] == [0.0, 1.0, 1.0, 0.0]
    assert [float(c) for c in counts] == [0.0, 0.0, 0.0, 0.0]
    increment_counts([new[2], new[1]])  # out of order: one add per counter, same values
    assert count_adds == [2]
    assert [float(c) for c in new] == [0.0, 2.0, 2.0, 0.0]
    loose = [torch.tensor(2.0), torch.tensor(3.0)]
    copies = copied_counts(loose)
    assert [float(c) for c in copies] == [2.0, 3.0]
    assert copies[0] is not loose[0]
