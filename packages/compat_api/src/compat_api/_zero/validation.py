"""Argument checks for ZeroRedundancyOptimizer, raising torch's exception types and messages.

Every check runs before anything is built or mutated, so a bad argument leaves the parameters,
the user's dicts and the process group untouched.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = [
    "check_default_group",
    "check_local_optimizer",
    "check_optimizer_class",
    "check_param_group",
    "check_same_dense_type",
    "check_saved_groups",
    "flatten_params",
    "iter_group_params",
    "refuse_sparse_grads",
]


def flatten_params(params: Any) -> tuple[list[Any], list[torch.Tensor]]:
    """Materialise ``params`` (tensors or param-group dicts) and list every parameter.

    A group's ``"params"`` given as a single tensor or a one-shot iterable (a generator) is
    replaced by a list in the group dict, which ``torch.optim.Optimizer`` would do anyway.

    Args:
        params: an iterable of tensors or of dicts with a ``"params"`` key.

    Returns:
        ``(persistent_params, all_params)``: a list to hand to ``Optimizer.__init__`` and the
        flat list of parameters in group order.

    Raises:
        TypeError: if ``params`` is a tensor, not iterable, mixes tensors and dicts, or a group
            holds something other than tensors.
        ValueError: if ``params`` is empty or a dict lacks the ``"params"`` key.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(
            f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}"
        )
    try:
        entries = list(params)
    except TypeError as e:
        raise TypeError(
            "`params` argument should be an iterable of Tensors or dicts, but got "
            f"{torch.typename(params)}"
        ) from e
    if not entries:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(entry, torch.Tensor) for entry in entries):
        return entries, list(entries)
    if not all(isinstance(entry, dict) for entry in entries):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    for group in entries:
        if "params" not in group:
            raise ValueError(
                "Each parameter group passed-in via `params` must have a 'params' key mapping "
                "to the parameters in the group"
            )
    group_params = [_group_members(group) for group in entries]
    for group, members in zip(entries, group_params):
        group["params"] = members
    return entries, [param for members in group_params for param in members]


def _group_members(group: dict[str, Any]) -> list[torch.Tensor]:
    """The parameters of one group as a list, checking that they are tensors."""
    members = group["params"]
    if isinstance(members, set):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but "
            "the ordering of tensors in sets will change between runs. Please use a list "
            "instead."
        )
    members = [members] if isinstance(members, torch.Tensor) else list(members)
    for member in members:
        if not isinstance(member, torch.Tensor):
            raise TypeError(
                "optimizer can only optimize Tensors, but one of the params is "
                + torch.typename(member)
            )
    return members


def check_same_dense_type(params: Sequence[torch.Tensor]) -> None:
    """Require one dense tensor type (same dtype and device type) for all parameters.

    Raises:
        ValueError: with torch's message, on a sparse first parameter or a type mismatch.
    """
    typename = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError(
            "ZeroRedundancyOptimizer only supports using the same dense type for all "
            f"parameters but got {typename}"
        )
    for param in params[1:]:
        other = torch.typename(param)
        if other != typename:
            raise ValueError(
                "ZeroRedundancyOptimizer only supports using the same dense type for all "
                f"parameters but got both {typename} and {other}"
            )


def check_param_group(param_group: Any, reference: torch.Tensor) -> list[torch.Tensor]:
    """Validate a group passed to ``add_param_group`` and return its parameters as a list.

    Args:
        param_group: the new group dict.
        reference: a parameter already managed, whose dense type the new ones must share.

    Raises:
        TypeError: if the group is not a dict or holds non-tensors.
        ValueError: if it lacks ``"params"`` or a parameter has another dense type.
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
    if "params" not in param_group:
        raise ValueError(
            "Each parameter group passed-in via `params` must have a 'params' key mapping "
            "to the parameters in the group"
        )
    params = _group_members(param_group)
    if params:
        check_same_dense_type([reference, *params])
    param_group["params"] = params
    return params


def _functional_classes() -> list[Any]:
    """torch's functional optimizers plus ours, if the user has imported them."""
    with warnings.catch_warnings():
        # Importing torch.distributed.optim runs its TorchScript interfaces (deprecated in 2.13).
        warnings.filterwarnings("ignore", message="`torch.jit", category=DeprecationWarning)
        from torch.distributed.optim.utils import functional_optim_map

    classes: list[Any] = list(functional_optim_map.values())
    ours = sys.modules.get("functional_optim.functional")
    if ours is not None:
        classes.extend(getattr(ours, name) for name in getattr(ours, "__all__", ()))
    return classes


def check_optimizer_class(optimizer_class: Any) -> Callable[..., Optimizer]:
    """Return the local optimizer constructor, or raise before anything is built.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass (any, including
            ``functional_optim`` adapters), or a callable that returns an Optimizer (e.g. a
            ``functools.partial``), which torch accepts too.

    Raises:
        ValueError: for a functional optimizer class (torch's message; those need
            ``overlap_with_ddp=True``).
        TypeError: for a class that is not an Optimizer subclass, or a non-callable.
    """
    if any(optimizer_class is cls for cls in _functional_classes()):
        raise ValueError(
            f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`"
        )
    if isinstance(optimizer_class, type):
        if not issubclass(optimizer_class, Optimizer):
            raise TypeError(
                "ZeroRedundancyOptimizer needs `optimizer_class` to be a torch.optim.Optimizer "
                f"subclass, but got {optimizer_class!r}"
            )
        return optimizer_class
    if not callable(optimizer_class):
        raise TypeError(
            "ZeroRedundancyOptimizer needs `optimizer_class` to be a torch.optim.Optimizer "
            f"subclass, but got {torch.typename(optimizer_class)}"
        )
    constructor: Callable[..., Optimizer] = optimizer_class
    return constructor


def check_default_group(process_group: Any) -> None:
    """Fail like torch when no group is given and the default group does not exist.

    Raises:
        ValueError: torch's "Default process group has not been initialized" error.
    """
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )


def check_local_optimizer(optim: Any, optimizer_class: Any) -> Optimizer:
    """Require the constructed local optimizer to be a ``torch.optim.Optimizer``.

    Raises:
        TypeError: if ``optimizer_class(...)`` returned something else.
    """
    if not isinstance(optim, Optimizer):
        raise TypeError(
            f"`optimizer_class` {optimizer_class!r} returned {torch.typename(optim)}, not a "
            "torch.optim.Optimizer"
        )
    return optim


def iter_group_params(param_groups: Iterable[dict[str, Any]]) -> Iterable[torch.Tensor]:
    """All parameters of ``param_groups`` in order."""
    for group in param_groups:
        yield from group["params"]


def check_saved_groups(saved_groups: Sequence[Mapping[str, Any]], optim: Any) -> None:
    """Refuse param groups saved by another optimizer than ``optim``, before anything loads.

    A group of ``optim``'s class holds every hyperparameter of its ``defaults``; torch fills in
    only the flags (``True``/``False``/``None``: ``fused``, ``capturable``, ...) that newer
    versions added. A saved group without one of the others (``betas`` for Adam, ``momentum``
    for SGD) comes from another optimizer: ``torch.optim``'s own ``load_state_dict`` would fail
    half-way (``KeyError: 'step'``) or leave a state that breaks the next ``step()``.

    Args:
        saved_groups: ``state_dict["param_groups"]`` of the state dict to load.
        optim: the local optimizer (a functional one, with ``overlap_with_ddp``, is not checked).

    Raises:
        ValueError: naming the missing hyperparameters and the saved group's own.
    """
    defaults = getattr(optim, "defaults", None)
    if not isinstance(optim, Optimizer) or not isinstance(defaults, Mapping):
        return
    required = sorted(k for k, v in defaults.items() if v is not None and not isinstance(v, bool))
    name = type(optim).__name__
    for index, group in enumerate(saved_groups):
        missing = [key for key in required if key not in group]
        if missing:
            theirs = sorted(k for k in group if k != "params" and k not in defaults)
            raise ValueError(
                f"loaded state dict's parameter group {index} has no {missing}: it was saved "
                f"by another optimizer than this ZeroRedundancyOptimizer's {name} (the group "
                f"holds {theirs or 'none of its own'} instead). Load a state dict saved with "
                f"{name}, or build the ZeroRedundancyOptimizer with the optimizer class that "
                "saved it. Nothing was loaded."
            )


def _local_sparse_error(
    constructor: Callable[..., Any], defaults: Mapping[str, Any], like: torch.Tensor
) -> Exception | None:
    """The error the local optimizer class raises for a sparse gradient, if it raises one.

    Steps a throwaway optimizer of the same class and options over a one-element parameter of
    its own (not a view: nothing is shared with the real parameters).
    """
    probe = torch.zeros(1, dtype=like.dtype, device=like.device, requires_grad=True)
    probe.grad = torch.sparse_coo_tensor(
        torch.zeros(1, 1, dtype=torch.long, device=like.device),
        torch.zeros(1, dtype=like.dtype, device=like.device),
        (1,),
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            constructor([{"params": [probe]}], **defaults).step()
    except Exception as exc:  # the class's own refusal, or a failure unrelated to sparsity
        return exc if "sparse" in str(exc).lower() else None
    return None


def refuse_sparse_grads(
    params: Iterable[torch.Tensor],
    constructor: Callable[..., Any],
    defaults: Mapping[str, Any],
    mode: str,
    instead: str,
) -> None:
    """Refuse sparse gradients before a step whose parameters are views of flat buffers.

    torch's in-place ``dense.add_(sparse)`` (what SGD, Adagrad... do with sparse gradients)
    writes outside a dense tensor that starts at an offset of its storage (torch 2.13, CPU),
    as the parameters of the bucket-view and flat modes do: the step would corrupt memory.

    Args:
        params: the parameters whose gradients the step reads.
        constructor: the local optimizer's constructor (``optimizer_class``).
        defaults: its options.
        mode: the ZeroRedundancyOptimizer option, for the message.
        instead: what to use instead, for the message.

    Raises:
        RuntimeError: the local optimizer class's own error when it refuses sparse gradients
            (torch's ``Adam does not support sparse gradients, please consider SparseAdam
            instead``), else one in the same style naming ``mode``. Nothing was changed.
    """
    sparse = next((p for p in params if p.grad is not None and p.grad.is_sparse), None)
    if sparse is None:
        return
    error = _local_sparse_error(constructor, defaults, sparse)
    if error is not None:
        raise error.with_traceback(None)
    raise RuntimeError(
        f"ZeroRedundancyOptimizer with {mode} does not support sparse gradients, please "
        f"consider {instead} instead"
    )
