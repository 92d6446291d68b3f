"""Step DTensor params (FSDP2, tensor parallel) on their local shards, as plain tensors.

Every op on a DTensor goes through DTensor dispatch, which costs more than the maths of a small
shard. ``fo.Optimizer`` therefore hands the fused step of a DTensor param group the *local*
tensors: ``p._local_tensor``, the local gradients, and the transform state with each DTensor
leaf replaced by its local tensor. The kernels update those in place, which updates the
DTensors they belong to, so the state stays DTensor outwardly (``opt.state``,
``state_dict()``, DCP); a leaf the step replaced is wrapped back with ``type(p).from_local``
and the spec of its param. Reductions over whole tensors read the shard context
(:mod:`functional_optim._shard_context`), installed for the step.

The conversion is cached per group: the local params by identity, and every state node
converted, both ways (``id(local node)`` and ``id(outer node)`` to the pair), so a step whose
state changed only near its root converts only that part.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

from functional_optim._base import OptState, StepFn
from functional_optim._owner_compute import check_matrix_group, outer_params
from functional_optim._shard_context import ShardInfo, shard_context
from functional_optim._sharded_matrix import check_muon_placements
from functional_optim._sharded_state import check_factored_placements, check_row_placements
from functional_optim._transforms.adafactor import ScaleByAdafactorState
from functional_optim._transforms.lbfgs import LbfgsState
from functional_optim._transforms.muon import ScaleByMuonState
from functional_optim._transforms.optax_layerwise import ScaleBySM3State
from functional_optim._transforms.per_matrix import PerMatrixState
from functional_optim._tree import NAMESPACE, NONE_IS_LEAF

__all__ = ["ShardedGroups", "is_dtensor"]

#: States of maths that reads whole tensors (factored or per-tensor statistics) that the local
#: step cannot compute on shards: a sharded param raises instead. (apply_if_finite, zero_nans
#: and skip_not_finite finish their flags over the shards: :mod:`functional_optim._sharded_flags`.)
_WHOLE_TENSOR_STATES: tuple[type, ...] = (
    ScaleByAdafactorState,  # but a local (fused) step: sharded sums (_sharded_adafactor)
    ScaleByMuonState,  # but fo.muon's fused step: one owner rank per matrix (_sharded_matrix)
    ScaleBySM3State,  # but a local (fused) step: max over the shards (scale_by_sm3)
    LbfgsState,
)

_Pair = tuple[Any, Any]

#: leaves that are their own outer and local form
_PLAIN_LEAVES = frozenset({type(None), float, int, bool, str})


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` looks like a DTensor (duck-typed: a local tensor and a device mesh)."""
    return isinstance(t, Tensor) and hasattr(t, "_local_tensor") and hasattr(t, "device_mesh")


def _shard_dims(placements: tuple[Any, ...], where: str) -> frozenset[int]:
    """The mesh dims a tensor is split over; raises for placements the local step can't take."""
    dims = set()
    for d, placement in enumerate(placements):
        if placement.is_shard() or type(placement).__name__ == "_StridedShard":
            dims.add(d)
        elif not placement.is_replicate():
            raise ValueError(
                f"{where} has placement {placement} on mesh dim {d}; fo.Optimizer steps "
                "DTensor params with Shard or Replicate placements only"
            )
    return frozenset(dims)


def _check_group(
    i: int, params: list[Any], state: OptState, fused: bool
) -> dict[int, ShardInfo] | None:
    """Validate a group; None when it has no DTensor. Returns ``id(local param) -> info``.
    A fused Muon step (``fo.muon``) orthogonalises sharded matrices on owner ranks."""
    flags = [is_dtensor(p) for p in params]
    if not any(flags):
        return None
    if not all(flags):
        plain, dt = flags.index(False), flags.index(True)
        raise ValueError(
            f"param {plain} of param group {i} is a plain tensor but param {dt} is a DTensor; "
            "put DTensor and plain params in different param groups"
        )
    mesh = params[0].device_mesh
    infos: dict[int, ShardInfo] = {}
    for k, p in enumerate(params):
        where = f"param {k} of param group {i}"
        if p.device_mesh is not mesh and p.device_mesh != mesh:
            raise ValueError(
                f"{where} is on device mesh {p.device_mesh}, param 0 on {mesh}; a param group "
                "must use one device mesh"
            )
        infos[id(p._local_tensor)] = ShardInfo(mesh, _shard_dims(p.placements, where), p.numel())
    nodes = _nodes(state)
    muon = fused and any(isinstance(n, ScaleByMuonState) for n in nodes)
    if muon:
        check_muon_placements(i, params)
    elif fused and _has(nodes, PerMatrixState):
        check_matrix_group(i, params, "per_matrix")
    # Adafactor and SM3 finish their statistics over FSDP2 row shards in a local step
    rows = tuple(t for t in (ScaleByAdafactorState, ScaleBySM3State) if fused and _has(nodes, t))
    for kind in rows:
        if kind is ScaleByAdafactorState:
            check_factored_placements(i, params)
        else:
            check_row_placements(i, params, "SM3")
    whole = [
        type(n).__name__
        for n in nodes
        if isinstance(n, _WHOLE_TENSOR_STATES)
        and not (muon and isinstance(n, ScaleByMuonState))
        and not isinstance(n, rows)
    ]
    sharded = [k for k, p in enumerate(params) if infos[id(p._local_tensor)].shard_dims]
    if whole and sharded:
        raise ValueError(
            f"param {sharded[0]} of param group {i} is sharded, but {whole[0]} needs whole "
            "tensors (factored or per-tensor statistics); fo.Optimizer can't step it on shards"
        )
    return infos


def _has(nodes: list[Any], kind: type) -> bool:
    return any(isinstance(n, kind) for n in nodes)


def _children(node: Any) -> tuple[list[Any], Callable[[list[Any]], Any]] | None:
    """A container's children and how to rebuild it; None for a leaf."""
    kind = type(node)
    if kind is list:
        return node, list
    if kind is tuple:
        return list(node), tuple
    if kind is dict:
        keys = list(node)
        return [node[k] for k in keys], lambda values: dict(zip(keys, values, strict=True))
    if isinstance(node, tuple) and hasattr(kind, "_fields"):
        return list(node), lambda values: kind(*values)
    if node is None or isinstance(node, (Tensor, float, int, bool, str)):
        return None
    if optree.tree_is_leaf(node, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE):
        return None
    out = optree.tree_flatten_one_level(node, none_is_leaf=NONE_IS_LEAF, namespace=NAMESPACE)
    meta, rebuild = out.metadata, out.unflatten_func
    return list(out.children), lambda values: rebuild(meta, values)


def _nodes(node: Any) -> list[Any]:
    """Every container node of a state tree."""
    parts = _children(node)
    if parts is None:
        return []
    return [node, *(n for child in parts[0] for n in _nodes(child))]


class _Converter:
    """Converts a group's state between its outer (DTensor) and local forms, remembering
    every pair of nodes it converted."""

    def __init__(self, params: list[Tensor], local_params: list[Tensor]) -> None:
        self.params = params
        self.local_params = local_params
        self.by_local: dict[int, _Pair] = {}
        self.by_outer: dict[int, _Pair] = {}
        self.base_size = 0

    def _record(self, local: Any, outer: Any) -> None:
        self.by_local[id(local)] = self.by_outer[id(outer)] = (local, outer)

    def _wrap(self, leaf: Tensor, owner: int | None) -> Tensor:
        """The outer form of a tensor the step made: a DTensor when it is a per-param buffer
        shaped like its param's shard."""
        if owner is None or leaf.dim() == 0 or is_dtensor(leaf):
            return leaf
        p: Any = self.params[owner]
        local = self.local_params[owner]
        if leaf.shape != local.shape:
            return leaf
        return type(p).from_local(  # type: ignore[no-any-return]
            leaf, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    def to_local(self, node: Any) -> Any:
        """The local form of an outer state node."""
        if type(node) in _PLAIN_LEAVES:
            return node
        hit = self.by_outer.get(id(node))
        if hit is not None and hit[1] is node:
            return hit[0]
        parts = _children(node)
        if parts is None:
            local = node._local_tensor if is_dtensor(node) else node
        else:
            children, rebuild = parts
            converted = [self.to_local(c) for c in children]
            same = all(map(operator.is_, converted, children))
            local = node if same else rebuild(converted)
        self._record(local, node)
        return local

    def to_outer(self, node: Any, owner: int | None = None) -> Any:
        """The outer form of a local state node (``owner``: the param a leaf belongs to)."""
        if type(node) in _PLAIN_LEAVES:
            return node
        hit = self.by_local.get(id(node))
        if hit is not None and hit[0] is node:
            return hit[1]
        parts = _children(node)
        if parts is None:
            outer = self._wrap(node, owner) if isinstance(node, Tensor) else node
        else:
            children, rebuild = parts
            per_param = type(node) is list and len(children) == len(self.params)
            converted = [self.to_outer(c, j if per_param else None) for j, c in enumerate(children)]
            same = all(map(operator.is_, converted, children))
            outer = node if same else rebuild(converted)
        self._record(node, outer)
        return outer

    def reset(self, outer: OptState) -> OptState:
        """Forget every pair, convert ``outer`` afresh and return its local form."""
        self.by_local.clear()
        self.by_outer.clear()
        local = self.to_local(outer)
        self.base_size = len(self.by_local)
        return local

    def grown(self) -> bool:
        """Whether the remembered pairs (stale ones keep old buffers alive) should be reset."""
        return len(self.by_local) > 2 * self.base_size + 256


class _GroupCache:
    """A group's local params, their shard infos and its state converter."""

    def __init__(self, params: list[Tensor], infos: dict[int, ShardInfo]) -> None:
        self.local_params = [p._local_tensor for p in params]  # type: ignore[attr-defined]
        self.infos = infos
        self.outer = {id(p._local_tensor): p for p in params}  # type: ignore[attr-defined]
        self.converter = _Converter(params, self.local_params)


class ShardedGroups:
    """``fo.Optimizer``'s local steps of its DTensor param groups (one cache per group)."""

    def __init__(self) -> None:
        self._caches: dict[int, _GroupCache | None] = {}
        self._params: dict[int, tuple[list[Tensor], int]] = {}

    def _cache(
        self, i: int, params: list[Tensor], state: OptState, fused: bool
    ) -> _GroupCache | None:
        known = self._params.get(i)
        if known is not None and known[0] is params and known[1] == len(params):
            cache = self._caches[i]
            if cache is None:
                return None
            local = [p._local_tensor for p in params]  # type: ignore[attr-defined]
            if len(local) == len(cache.local_params) and all(
                map(operator.is_, local, cache.local_params)
            ):
                return cache
        infos = _check_group(i, params, state, fused)
        cache = None if infos is None else _GroupCache(params, infos)
        self._caches[i], self._params[i] = cache, (params, len(params))
        return cache

    def prepared(
        self, i: int, params: list[Tensor], state: OptState, fused: StepFn | None
    ) -> Callable[[], OptState] | None:
        """Check group ``i`` and return its local step: a call that runs ``fused`` on the
        group's local tensors and returns the new (outer) state. None when the group has no
        DTensor param or the transform has no fused step (the caller then steps the DTensors
        themselves). Everything is checked here, before anything changes.

        Args:
            i: the group's index.
            params: the group's params.
            state: the group's transform state (DTensor leaves).
            fused: the transform's ``step``.

        Raises:
            ValueError: DTensor and plain params in one group, params on different meshes,
                a placement other than Shard / Replicate, a sharded param under a transform
                that needs whole tensors (Adafactor, a Muon without its fused step, ...), a
                fused Muon step on a param other than ``Shard(0)`` on a 1-D mesh, a gradient
                whose placements differ from its param's.
            TypeError: a plain gradient on a DTensor param.
        """
        cache = self._cache(i, params, state, fused is not None)
        if cache is None or fused is None:
            return None
        grads = _local_grads(i, params)

        def run() -> OptState:
            converter = cache.converter
            local_state = converter.to_local(state)
            with shard_context(cache.infos), outer_params(cache.outer):
                new_local = fused(cache.local_params, grads, local_state)
            outer = converter.to_outer(new_local)
            if converter.grown():
                converter.reset(outer)
            return outer

        return run


def _local_grads(i: int, params: list[Any]) -> list[Tensor | None]:
    """The local tensors of the params' DTensor gradients (checked against their params)."""
    with torch._C.DisableTorchFunctionSubclass():  # a DTensor's ``.grad`` costs less so
        grads = [p.grad for p in params]
    for k, (g, p) in enumerate(zip(grads, params, strict=True)):
        if g is None:
            continue
        if type(g) is not type(p) and not is_dtensor(g):
            raise TypeError(
                f"param {k} of param group {i} is a DTensor but its gradient is a plain tensor"
            )
        if g._spec.placements is not p._spec.placements and g.placements != p.placements:
            raise ValueError(
                f"the gradient of param {k} of param group {i} has placements "
                f"{g.placements}, its param {p.placements}; reduce it (e.g. redistribute) "
                "before the step"
            )
    return [None if g is None else g._local_tensor for g in grads]
