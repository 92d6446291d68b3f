"""ZeroRedundancyOptimizer under ``torch.distributed.checkpoint.state_dict`` (DSD), unconsolidated.

``get_optimizer_state_dict(model, zero)`` / ``set_optimizer_state_dict(model, zero, osd)`` work
in every partition mode without :meth:`consolidate_state_dict`: each rank gives and takes its
own share (see :mod:`dist_runtime.dcp_optimizer_state` for the layout), and ``dcp.save`` /
``dcp.load`` reshard it across world sizes and partition modes. What DSD reads, and how:

- ``zero.state`` (:class:`ZeroState`): truthy once the optimizer has state (it stepped or
  loaded, the same on every rank), so DSD's state initialisation (a zero-gradient,
  zero-learning-rate ``step()``) runs only on a fresh optimizer, on every rank alike, and never
  advances a live one; ``zero.state[param]`` of a parameter without an entry of its own is the
  live state this rank's local optimizer keeps for it (``{}`` elsewhere), not inserted, so
  ``len(zero.state)`` stays torch's;
- ``zero.state_dict()`` called by DSD: :func:`dcp_state_dict` (a direct call keeps torch's
  "not consolidated" error);
- ``zero.load_state_dict(osd)`` of a dict whose params are names (what DSD passes):
  :func:`load_named_state_dict`.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from compat_api._zero.dcp_lowbit import lowbit_formats, lowbit_pieces_from_dsd, lowbit_state_view
from compat_api._zero.layout import sync_param_groups
from compat_api._zero.strategy import ZeroContext, _local_state_dict
from compat_api._zero.validation import check_saved_groups
from dist_runtime.dcp_optimizer_state import index_state_dict, piece_values

__all__ = [
    "ZeroState",
    "dcp_state_dict",
    "load_named_state_dict",
    "mark_has_state",
    "uses_param_names",
]


class ZeroState(defaultdict[Any, Any]):
    """``ZeroRedundancyOptimizer.state``: torch's (mostly empty) dict, seen through by DSD.

    Args:
        owner: the optimizer.
        initial: the entries to start with (what ``Optimizer`` set).
        has_state: whether the optimizer has stepped or loaded already.
    """

    def __init__(self, owner: Any, initial: Mapping[Any, Any], has_state: bool = False) -> None:
        super().__init__(dict, initial)
        self._owner = weakref.ref(owner)
        #: Set on every rank by a step or a load: what ``bool(state)`` reports.
        self.has_state = has_state

    def __reduce__(self) -> Any:
        # copies and pickles are plain dicts (the owner is not copied with them)
        return (defaultdict, (dict,), None, None, iter(self.items()))

    def __bool__(self) -> bool:
        return self.has_state or len(self) > 0

    def __missing__(self, key: Any) -> Any:
        owner = self._owner()
        optim = getattr(owner, "optim", None)  # the overlap mode builds it late
        if owner is None or optim is None or not getattr(owner, "initialized", False):
            return super().__missing__(key)
        local = optim.state
        live = local.get(key) if key in local else None
        if live is None and isinstance(key, torch.Tensor):
            index = owner._layout.param_to_index.get(key)
            for tensor, piece in owner.strategy.owned_pieces(owner).items():
                if piece.param_index == index and tensor in local:
                    live = local[tensor]
                    break
        return {} if live is None else live


def mark_has_state(zero: Any) -> None:
    """Record that ``zero`` has optimizer state (after a step or a load, on every rank)."""
    state = zero.state
    if isinstance(state, ZeroState):
        state.has_state = True
    else:  # Optimizer.load_state_dict rebound it
        zero.state = ZeroState(zero, state, has_state=True)


def _groups_with_indices(zero: ZeroContext) -> list[dict[str, Any]]:
    index_of = zero._layout.param_to_index
    return [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [index_of[p] for p in g["params"]],
        }
        for g in zero.param_groups
    ]


def dcp_state_dict(zero: ZeroContext, strategy: Any) -> dict[str, Any]:
    """This rank's share of the state in torch's layout, for DSD (call on every rank).

    ``state`` has an entry for every parameter: its live state where this rank's local
    optimizer holds it (whole, or a ``ShardedTensor`` for a parameter cut across ranks), ``{}``
    elsewhere (DSD's strict loading wants an entry per trainable parameter); ``param_groups``
    are the wrapper's, with global indices.

    Args:
        zero: the optimizer.
        strategy: its strategy (owns the pieces).

    Returns:
        ``{"state": {index: {name: value}}, "param_groups": [...]}``.
    """
    sync_param_groups(zero.param_groups, zero.optim.param_groups)
    pieces = strategy.owned_pieces(zero)
    formats = lowbit_formats(zero)
    source = lowbit_state_view(zero, pieces, formats) if formats else zero.optim
    mine = index_state_dict(source, pieces, zero.process_group)
    count = len(zero._layout.index_to_param)
    return {
        "state": {i: mine.get(i, {}) for i in range(count)},
        "param_groups": _groups_with_indices(zero),
    }


def uses_param_names(state_dict: Mapping[str, Any]) -> bool:
    """Whether a state dict names its parameters (DSD's layout) instead of numbering them."""
    groups = state_dict.get("param_groups", [])
    keys = [k for g in groups for k in g.get("params", [])] + list(state_dict.get("state", {}))
    return any(isinstance(k, str) for k in keys)


def load_named_state_dict(zero: ZeroContext, strategy: Any, state_dict: Mapping[str, Any]) -> None:
    """Load this rank's share of a DSD state dict (params named, as DSD hands it over).

    The groups' params name the parameters in the order of ``zero.param_groups`` (DSD builds
    them so). Each rank reads the state of the pieces its local optimizer holds: whole values
    are sliced, ``ShardedTensor`` values read from their local shards; a parameter without an
    entry gets no state (torch's ``load_state_dict`` replaces the state). The local optimizer
    loads through its own ``load_state_dict``.

    Args:
        zero: the optimizer.
        strategy: its strategy.
        state_dict: ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}]}``.

    Raises:
        ValueError: torch's messages when the groups or their sizes differ; a saved group
            that lacks the local optimizer's hyperparameters; a sharded value that does not
            hold this rank's elements (all before anything changes).
    """
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(zero.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, zero.param_groups)):
        raise ValueError(
            "loaded state dict contains a parameter group that doesn't match the size of "
            "optimizer's group"
        )
    check_saved_groups(saved_groups, zero.optim)
    name_of_index = [name for group in saved_groups for name in group["params"]]
    saved_state = state_dict["state"]
    local: dict[torch.Tensor, Any] = {}
    formats = lowbit_formats(zero)
    for tensor, piece in strategy.owned_pieces(zero).items():
        saved = saved_state.get(name_of_index[piece.param_index])
        if saved:
            values = piece_values(saved, piece, tuple(tensor.shape))
            local[tensor] = lowbit_pieces_from_dsd(values, piece, formats.get(piece.param_index))
    loaded = _local_state_dict(zero.optim, local, list(saved_groups))
    bindings = dict(vars(zero.optim))
    try:
        with strategy.lowbit_context():
            zero.optim.load_state_dict(loaded)
    except Exception:
        vars(zero.optim).clear()
        vars(zero.optim).update(bindings)
        raise
    sync_param_groups(saved_groups, zero.param_groups)
    sync_param_groups(zero.param_groups, zero.optim.param_groups)
    mark_has_state(zero)
