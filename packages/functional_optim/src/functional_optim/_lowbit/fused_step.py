"""The one-pass step of Adam / AdamW with low-bit moments on CPU (:mod:`.fused_cpu`).

The inner transform's own ``step`` runs once over every quantised param, with param-shaped
stand-ins for its moments; its kernel call (:mod:`functional_optim._kernel_runner`) reaches
:class:`_Fused`, which advances the step counters and runs the C++ step on the params and the
moments' codes and scales. Everything else of the inner step (its input checks, its learning
rate, its other state) is its own. It applies where nothing needs the batched path: fp32
contiguous CPU tensors (checked by the extension before it changes anything), every quantised
param with a gradient, no block shared with another rank, an Adam or AdamW kernel without
AMSGrad, and the extension built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from functional_optim._kernel_runner import Role, running_with
from functional_optim._lowbit import fused_cpu
from functional_optim._lowbit.adam_maths import decoupled, replaced_kernel
from functional_optim._lowbit.codes import CodeMap
from functional_optim._lowbit.layout import GroupLayout

__all__ = ["fused_step"]

_PLAIN = (Tensor, torch.nn.Parameter)


class _NotFusedError(Exception):
    """The inner kernel is not one the C++ step replaces (nothing was changed)."""


class _Fused:
    """A kernel runner: the Adam kernel's call runs the C++ step on the codes and scales."""

    def __init__(
        self,
        module: Any,
        moments: list[list[Tensor]],
        block_size: int,
        kind: str,
        int4_maps: list[Tensor],
    ) -> None:
        self.module, self.moments, self.bs, self.kind = module, moments, block_size, kind
        self.int4_maps = int4_maps

    def __call__(self, kernel: Callable[..., None], args: list[Any], roles: Sequence[Role]) -> None:
        if not replaced_kernel(kernel, args):
            raise _NotFusedError
        moments, bs, kind, maps = self.moments, self.bs, self.kind, self.int4_maps
        if not fused_cpu.step(self.module, args, moments, decoupled(kernel), bs, kind, maps):
            raise _NotFusedError


def fused_step(
    run: Any,
    js: list[int],
    grads: Sequence[Any],
    layout: GroupLayout,
    moments: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    second: Sequence[bool],
    block_size: int,
    kind: str,
    cmaps: Sequence[CodeMap],
) -> bool:
    """Step the quantised params ``js`` in one pass; False (nothing changed) where
    :mod:`this module <.fused_step>` does not apply.

    Args:
        run: the step's lists (:class:`.step._Run`).
        js: the quantised params, in order.
        grads: every param's gradient.
        layout: the group's layout.
        moments: ``(codes, scales)`` leaves of each moment (one per param, checked against
            the layout), in ``run.moment_refs`` order.
        second: whether each moment is a second moment (non-negative).
        block_size: elements per block.
        kind: a kind the C++ step takes (:data:`.fused_cpu.KINDS`).
        cmaps: each moment's code map.
    """
    params = [run.params[j] for j in js]
    if (
        not js
        or torch.compiler.is_compiling()  # the kernel seam is bypassed there
        or layout.shared
        or sorted(second) != [False, True]
        or any(layout.pad_front[j] for j in js)
        or not all(type(p) in _PLAIN for p in params)
        or not all(type(grads[j]) in _PLAIN for j in js)
    ):
        return False
    lists = []
    for codes, scales in moments:
        c = [codes[j] for j in js]
        s = [scales[j] for j in js]
        if any(x is None for x in c):
            return False  # the first step lays the buffers out (the batched path)
        lists.append((c, s))
    module = fused_cpu.extension()
    if module is None:
        return False
    m, v = (1, 0) if second[0] else (0, 1)
    order = [lists[m][0], lists[m][1], lists[v][0], lists[v][1]]
    maps = [t for k in (m, v) for t in (cmaps[k].table, cmaps[k].base, cmaps[k].split)]
    stand_ins = [_stand_in(p) for p in params]
    try:
        with running_with(_Fused(module, order, block_size, kind, maps if kind == "int4" else [])):
            run.call(js, params, [grads[j] for j in js], [stand_ins] * len(moments), set())
    except _NotFusedError:
        return False
    return True


_STAND_INS: dict[tuple[torch.Size, torch.dtype], Tensor] = {}


def _stand_in(p: Tensor) -> Tensor:
    """A param-shaped tensor without memory (what the inner step's checks see as a moment)."""
    key = (p.shape, p.dtype)
    t = _STAND_INS.get(key)
    if t is None:
        if len(_STAND_INS) > 256:
            _STAND_INS.clear()
        t = _STAND_INS[key] = torch.zeros((), dtype=p.dtype).expand(p.shape)
    return t
