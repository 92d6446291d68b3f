"""Convert transform states to and from torch's per-param state dicts (the compat edge only).

``to_torch_state(state, params)`` gives, per param, a dict like ``torch.optim.Adam``'s
(``{"step": ..., "exp_avg": ..., "exp_avg_sq": ...}``) plus a dict of group-level entries
(state not shaped like the params, e.g. a schedule's count), keyed by their position in the
chain. ``from_torch_state`` is its inverse, given a template state from ``tx.init(params)``.

Per-param fields of the built-in states use torch's names; fields of other states use their
own name, prefixed by the component's position in the chain (``"3.mu"``) when the name is
already taken. ``None`` entries (a buffer not created yet) are left out, as torch leaves out
state it has not created. Two declarations follow torch's layout where it is not one tensor
per param: :data:`TORCH_INT_FIELDS` (per-param counts torch keeps as Python ints, SparseAdam's
``step``) and :data:`TORCH_FIRST_PARAM_STATE` (a state torch keeps whole in its first param's
dict, LBFGS's).

``check_torch_state`` validates torch-style dicts against a template before anything is
loaded (``fo.Optimizer.load_state_dict`` runs it first): every per-param entry of a param that
has state, with the template's size, a step count that is a number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from numbers import Real
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import OptState
from functional_optim._counts import detached_count, repacked_like
from functional_optim._registry import TORCH_STATE_NAMES
from functional_optim._transforms.hyperparams import InjectHyperparamsState
from functional_optim._transforms.lbfgs import LbfgsState, check_memory, loaded_memory
from functional_optim._transforms.sparse_adam import ScaleBySparseAdamState
from functional_optim._tree import PyTree, TreeSpec, tree_structure

__all__ = [
    "TORCH_FIRST_PARAM_STATE",
    "FirstParamState",
    "TORCH_INT_FIELDS",
    "check_torch_state",
    "from_torch_state",
    "to_torch_state",
    "tree_nodes",
]


#: State type -> (field -> torch's per-param state key), from the algorithm registry (the live
#: dict: an algorithm registered at run time is found too).
_TORCH_NAMES: dict[type, dict[str, str]] = TORCH_STATE_NAMES

#: State type -> its per-param count fields that torch keeps as Python ints: exported as
#: ``int``, loaded from an int or a tensor (torch's SparseAdam ``state["step"]``).
TORCH_INT_FIELDS: dict[type, frozenset[str]] = {ScaleBySparseAdamState: frozenset({"count"})}


class FirstParamState(NamedTuple):
    """A state torch keeps whole in the dict of the group's first param (``state[params[0]]``).

    Attributes:
        field: the state's field holding it, a dict of torch's entries (exported into that
            param's dict as they are).
        check: ``check(loaded, params, where)`` raises for a loaded dict that does not fit
            ``params`` (the group's leaves), before anything is loaded.
        load: ``load(loaded, params)`` gives the field's new value from a loaded dict (the
            first param's entries, but those of per-param fields of other components).
    """

    field: str
    check: Callable[[Mapping[str, Any], Sequence[Any], str], None]
    load: Callable[[Mapping[str, Any], Sequence[Any]], dict[str, Any]]


#: State type -> :class:`FirstParamState`: torch's LBFGS has only global state and stores it
#: in its first param's dict (``func_evals``, ``n_iter``, ``d``, ``t``, ``old_dirs``, ...).
TORCH_FIRST_PARAM_STATE: dict[type, FirstParamState] = {
    LbfgsState: FirstParamState("memory", check_memory, loaded_memory)
}


class _Key(NamedTuple):
    """Where one state field goes: its key, and how it is laid out."""

    key: str
    kind: str  # "param" (one entry per param), "group" (fo_state) or "first" (first param's)
    as_int: bool = False  # a per-param count exported as a Python int


def _is_component(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(node, "_fields")


def _components(node: OptState, path: tuple[int, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, component state)`` for every NamedTuple state in a (chained) state."""
    if isinstance(node, InjectHyperparamsState):
        yield from _components(node.inner_state, path)
    elif _is_component(node):
        yield ".".join(map(str, path)), node
    elif isinstance(node, (tuple, list)):
        for i, child in enumerate(node):
            yield from _components(child, (*path, i))
    else:
        raise TypeError(f"cannot convert a state node of type {type(node).__name__}")


def tree_nodes(state: OptState) -> Iterator[Any]:
    """Every component state of a (chained, injected) state, as :func:`to_torch_state` sees
    them."""
    for _, comp in _components(state):
        yield comp


def _keys(state: OptState, spec: TreeSpec) -> dict[tuple[str, str], _Key]:
    """Map ``(component path, field)`` to its :class:`_Key` for every field."""
    out: dict[tuple[str, str], _Key] = {}
    used: set[str] = set()
    for path, comp in _components(state):
        names = _TORCH_NAMES.get(type(comp), {})
        ints = TORCH_INT_FIELDS.get(type(comp), frozenset())
        first = TORCH_FIRST_PARAM_STATE.get(type(comp))
        for field in comp._fields:
            value = getattr(comp, field)
            if first is not None and field == first.field and spec.num_leaves > 0:
                out[(path, field)] = _Key(field, "first")
                continue
            per_param = value is not None and tree_structure(value) == spec
            key = names.get(field, field)
            if not per_param or key in used:
                key = f"{path}.{key}" if path else key
            used.add(key)
            out[(path, field)] = _Key(key, "param" if per_param else "group", field in ints)
    return out


def _first_index(leaves: Sequence[Any]) -> int:
    """The position of the first param (torch's ``self._params[0]``): the first tensor leaf."""
    return next((i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)), 0)


def _first_param_dict(d: Mapping[str, Any], keys: Mapping[tuple[str, str], _Key]) -> dict[str, Any]:
    """The first param's dict ``d`` without the entries of per-param fields."""
    taken = {k.key for k in keys.values() if k.kind == "param"}
    return {k: v for k, v in d.items() if k not in taken}


def to_torch_state(state: OptState, params: PyTree) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Split a transform state into torch-style per-param dicts and group-level entries.

    Args:
        state: the state of a transform initialised on ``params``.
        params: the params pytree (gives the per-param structure and order).

    Returns:
        ``(per_param, group_state)``: ``per_param[i]`` is param ``i``'s dict (tensors shared
        with ``state``, not copied, except the step counters: they are views into one buffer,
        see :mod:`functional_optim._counts`, and come out as standalone copies, so that
        pickling the dict does not copy that buffer once per param); ``group_state`` holds the
        other entries.
    """
    spec = tree_structure(params)
    per_param: list[dict[str, Any]] = [{} for _ in range(spec.num_leaves)]
    group: dict[str, Any] = {}
    keys = _keys(state, spec)
    for path, comp in _components(state):
        for field in comp._fields:
            key, kind, as_int = keys[(path, field)]
            value = getattr(comp, field)
            if value is None:
                continue
            if kind == "first":
                per_param[_first_index(spec.flatten_up_to(params))].update(value)
            elif kind == "param":
                leaves: list[Any] = spec.flatten_up_to(value)
                for d, leaf in zip(per_param, leaves, strict=True):
                    if leaf is not None:
                        d[key] = int(leaf.item()) if as_int else detached_count(leaf)
            else:
                group[key] = value
    return per_param, group


def _restore(template: Any, loaded: Any) -> Any:
    if isinstance(template, Tensor) and isinstance(loaded, Tensor):
        return loaded.to(dtype=template.dtype, device=template.device)
    if isinstance(template, Tensor) and isinstance(loaded, Real):  # torch's ``"step": 3``
        return torch.tensor(float(loaded), dtype=template.dtype, device=template.device)
    return loaded


def _check_value(key: str, where: str, loaded: Any, template: Any, param: Any) -> None:
    """One loaded entry against the template's (``None``: a buffer created lazily, shaped
    like its param)."""
    if template is None:
        template = param
        if not isinstance(template, Tensor):
            return
    if not isinstance(template, Tensor):
        return  # not a tensor in the transform state either: taken as it is
    if template.dim() == 0 and param is not None and (param.dim() != 0 or key == "step"):
        _check_number(key, where, loaded)  # a per-param scalar (a step count)
        return
    if not isinstance(loaded, Tensor):
        raise TypeError(
            f"state {key!r} of {where} is a {type(loaded).__name__}, not a tensor; load a state "
            "dict saved by an optimizer of this algorithm"
        )
    if loaded.shape != template.shape:
        raise RuntimeError(
            f"the size of state {key!r} of {where} ({list(loaded.shape)}) must match the size "
            f"this optimizer keeps for it ({list(template.shape)}); the state dict was saved "
            "for other params: load it into an optimizer over the same params, in order"
        )


def _check_number(key: str, where: str, loaded: Any) -> None:
    if isinstance(loaded, Tensor):
        if loaded.numel() != 1:
            raise RuntimeError(
                f"state {key!r} of {where} must hold one number, got a tensor of shape "
                f"{list(loaded.shape)}"
            )
        if loaded.is_complex():
            raise ValueError(f"state {key!r} of {where} must be a real number, got {loaded}")
        return
    if not isinstance(loaded, Real):  # torch: float(state["step"]) fails with a ValueError
        raise ValueError(
            f"state {key!r} of {where} must be a number or a 1-element tensor, got "
            f"{type(loaded).__name__} {loaded!r}"
        )


def check_torch_state(
    template: OptState,
    params: PyTree,
    per_param: Sequence[Mapping[str, Any] | None],
    group_state: Mapping[str, Any] | None = None,
    first: int = 0,
) -> None:
    """Check torch-style dicts against a transform's state before loading them.

    A param with no entry (or an empty one) is fine: its state is created at its first step,
    as torch creates it. A param with an entry must have every per-param entry of the template
    (torch's keys, in field order; a lazily created buffer, as SGD's ``momentum_buffer``, may
    be absent), with the template's size (the param's for a lazily created one), and per-param
    scalars (``step``) must be numbers. A whole-group state kept in the first param's dict
    (:data:`TORCH_FIRST_PARAM_STATE`, LBFGS's) is checked by its ``check``.

    Args:
        template: ``tx.init(params)``.
        params: the params pytree.
        per_param: one dict (or None) per param, in ``params`` leaf order.
        group_state: the group-level entries (``param_groups[i]["fo_state"]``).
        first: the index of the first param in messages (its position in the state dict).

    Raises:
        KeyError: a per-param entry is missing (torch's ``KeyError('step')``).
        ValueError: a step count is not a number; ``per_param`` has the wrong length.
        RuntimeError: a tensor's size is not the template's (or a count holds several values).
        TypeError: an entry that should be a tensor (or a list of them) is not one.
    """
    spec = tree_structure(params)
    if len(per_param) != spec.num_leaves:
        raise ValueError(f"got {len(per_param)} per-param dicts for {spec.num_leaves} params")
    leaves = spec.flatten_up_to(params)
    group_state = group_state or {}
    keys = _keys(template, spec)
    for path, comp in _components(template):
        for field in comp._fields:
            key, kind, _ = keys[(path, field)]
            value = getattr(comp, field)
            if kind == "first":
                i = _first_index(leaves)
                loaded = _first_param_dict(per_param[i] or {}, keys)
                TORCH_FIRST_PARAM_STATE[type(comp)].check(loaded, leaves, f"param {first + i}")
            elif kind == "param":
                values: list[Any] = spec.flatten_up_to(value)
                for j, (leaf, d) in enumerate(zip(values, per_param, strict=True)):
                    if not d:
                        continue
                    if key not in d:
                        if leaf is None:
                            continue  # created lazily (SGD's momentum_buffer): may be absent
                        raise KeyError(key)
                    _check_value(key, f"param {first + j}", d[key], leaf, leaves[j])
            elif key in group_state and isinstance(value, Tensor):
                _check_value(key, "the param group", group_state[key], value, None)


def from_torch_state(
    template: OptState,
    params: PyTree,
    per_param: Sequence[dict[str, Any]],
    group_state: dict[str, Any] | None = None,
) -> OptState:
    """Rebuild a transform state from torch-style dicts (inverse of :func:`to_torch_state`).

    Args:
        template: ``tx.init(params)``: gives the structure, dtypes and devices; its values are
            kept where the dicts have no entry (torch creates state lazily).
        params: the params pytree.
        per_param: one dict per param, in ``params`` leaf order.
        group_state: the group-level entries.

    Returns:
        A state of the template's structure, values cast to the template's dtypes and devices
        (step counters packed into one new buffer as ``init`` packs them, Python-int counts as
        tensors; the template is not written to). A whole-group state of
        :data:`TORCH_FIRST_PARAM_STATE` is what its ``load`` makes of the first param's dict.

    Raises:
        ValueError: if ``per_param`` has the wrong length.
    """
    spec = tree_structure(params)
    if len(per_param) != spec.num_leaves:
        raise ValueError(f"got {len(per_param)} per-param dicts for {spec.num_leaves} params")
    group_state = group_state or {}
    keys = _keys(template, spec)
    rebuilt: dict[str, Any] = {}
    for path, comp in _components(template):
        values: dict[str, Any] = {}
        for field in comp._fields:
            key, kind, _ = keys[(path, field)]
            value = getattr(comp, field)
            if kind == "first":
                leaves = spec.flatten_up_to(params)
                loaded = per_param[_first_index(leaves)]
                load = TORCH_FIRST_PARAM_STATE[type(comp)].load
                values[field] = load(_first_param_dict(loaded, keys), leaves) if loaded else value
            elif value is None:
                values[field] = None
            elif kind == "param":
                leaves = spec.flatten_up_to(value)
                new = [
                    _restore(leaf, d[key]) if key in d else leaf
                    for leaf, d in zip(leaves, per_param, strict=True)
                ]
                values[field] = spec.unflatten(repacked_like(leaves, new))
            else:
                values[field] = _restore(value, group_state[key]) if key in group_state else value
        rebuilt[path] = type(comp)(**values)
    return _replace_components(template, rebuilt)


def _replace_components(node: OptState, rebuilt: dict[str, Any], path: tuple[int, ...] = ()) -> Any:
    if isinstance(node, InjectHyperparamsState):
        return node._replace(inner_state=_replace_components(node.inner_state, rebuilt, path))
    if _is_component(node):
        return rebuilt[".".join(map(str, path))]
    children = [_replace_components(c, rebuilt, (*path, i)) for i, c in enumerate(node)]
    return type(node)(children)
