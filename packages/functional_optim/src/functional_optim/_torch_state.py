"""Convert transform states to and from torch's per-param state dicts (the compat edge only).

``to_torch_state(state, params)`` gives, per param, a dict like ``torch.optim.Adam``'s
(``{"step": ..., "exp_avg": ..., "exp_avg_sq": ...}``) plus a dict of group-level entries
(state not shaped like the params, e.g. a schedule's count), keyed by their position in the
chain. ``from_torch_state`` is its inverse, given a template state from ``tx.init(params)``.

Per-param fields of the built-in states use torch's names; fields of other states use their
own name, prefixed by the component's position in the chain (``"3.mu"``) when the name is
already taken. ``None`` entries (a buffer not created yet) are left out, as torch leaves out
state it has not created.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from functional_optim._base import OptState
from functional_optim._counts import detached_count, repacked_like
from functional_optim._registry import TORCH_STATE_NAMES
from functional_optim._transforms.hyperparams import InjectHyperparamsState
from functional_optim._tree import PyTree, TreeSpec, tree_structure

__all__ = ["from_torch_state", "to_torch_state"]


#: State type -> (field -> torch's per-param state key), from the algorithm registry (the live
#: dict: an algorithm registered at run time is found too).
_TORCH_NAMES: dict[type, dict[str, str]] = TORCH_STATE_NAMES


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


def _keys(state: OptState, spec: TreeSpec) -> dict[tuple[str, str], tuple[str, bool]]:
    """Map ``(component path, field)`` to ``(torch key, per_param)`` for every field."""
    out: dict[tuple[str, str], tuple[str, bool]] = {}
    used: set[str] = set()
    for path, comp in _components(state):
        names = _TORCH_NAMES.get(type(comp), {})
        for field in comp._fields:
            value = getattr(comp, field)
            per_param = value is not None and tree_structure(value) == spec
            key = names.get(field, field)
            if not per_param or key in used:
                key = f"{path}.{key}" if path else key
            used.add(key)
            out[(path, field)] = (key, per_param)
    return out


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
            key, is_per_param = keys[(path, field)]
            value = getattr(comp, field)
            if value is None:
                continue
            if is_per_param:
                for d, leaf in zip(per_param, spec.flatten_up_to(value), strict=True):
                    if leaf is not None:
                        d[key] = detached_count(leaf)
            else:
                group[key] = value
    return per_param, group


def _restore(template: Any, loaded: Any) -> Any:
    if isinstance(template, Tensor) and isinstance(loaded, Tensor):
        return loaded.to(dtype=template.dtype, device=template.device)
    return loaded


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
        (step counters packed into one new buffer as ``init`` packs them; the template is not
        written to).

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
            key, is_per_param = keys[(path, field)]
            value = getattr(comp, field)
            if value is None:
                values[field] = None
            elif is_per_param:
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
