"""Where an optimizer-in-backward step attaches to a plain module, DDP and FSDP2.

* plain module: a parameter's post-accumulate-grad hook sees its final gradient.
* DDP: those hooks fire *before* the bucket's all-reduce (the reducer's own autograd hook runs
  after them), so the step runs in a DDP communication hook instead, once the bucket is
  averaged (the gradients become views of the bucket, freeing the local ones); gradient
  accumulation uses :meth:`~torch.nn.parallel.DistributedDataParallel.no_sync`.
* FSDP2 (``fully_shard``, torch 2.13): FSDP2 calls the sharded parameters' post-accumulate-grad
  hooks itself, right after the reduce-scatter wrote the averaged shard into ``.grad`` (the
  sharded parameters never reach autograd), so the plain-module hook works unchanged;
  accumulation uses ``set_requires_gradient_sync(False)``.

Used by :mod:`dist_runtime.backward_step`; nothing here keeps state of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "WrapperKind",
    "ddp_step_hook",
    "gradient_sync",
    "local_grad",
    "sum_across_shards",
    "wrapper_kind",
]

WrapperKind = Literal["plain", "ddp", "fsdp2"]


def wrapper_kind(model: object) -> WrapperKind:
    """Which data-parallel wrapper ``model`` is (``"plain"`` for anything else)."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, FSDPModule):
        return "fsdp2"
    return "plain"


def local_grad(grad: Tensor) -> Tensor:
    """The local tensor of a (possibly DTensor) gradient; in-place ops on it reach ``grad``."""
    return grad._local_tensor if isinstance(grad, DTensor) else grad


@contextlib.contextmanager
def gradient_sync(model: nn.Module | None, kind: WrapperKind, enabled: bool) -> Iterator[None]:
    """Run the body with the wrapper's gradient synchronisation on or off.

    Off is DDP's ``no_sync()`` or FSDP2's ``set_requires_gradient_sync(False)`` (restored to
    ``True`` on exit); on, and for a plain module, the body runs unchanged.
    """
    if enabled or model is None or kind == "plain":
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        assert isinstance(model, FSDPModule)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def sum_across_shards(value: Tensor, grads: list[Tensor]) -> Tensor:
    """All-reduce (sum) ``value`` over the mesh of the first DTensor in ``grads``; returned
    unchanged when there is none (replicated gradients: plain module, DDP).

    Raises:
        ValueError: the DTensor gradients live on a mesh of more than one dimension.
    """
    mesh = next((g.device_mesh for g in grads if isinstance(g, DTensor)), None)
    if mesh is None:
        return value
    if mesh.ndim != 1:
        raise ValueError("clip_mode='previous' supports 1-D FSDP2 meshes only")
    dist.all_reduce(value, group=mesh.get_group())
    return value


StepBucket = Callable[[list[Tensor], list[Tensor]], None]


def ddp_step_hook(
    ddp: DistributedDataParallel, step_bucket: StepBucket, stepping: Callable[[], bool]
) -> Callable[[Any, GradBucket], torch.futures.Future[Tensor]]:
    """A DDP communication hook that averages each bucket as DDP does, then, when
    ``stepping()``, calls ``step_bucket(params, averaged_grads)``.

    The averaging is DDP's built-in one, in its order: scale by ``1 / world_size`` (DDP's
    reducer multiplies while copying into the bucket), then all-reduce (sum). The step runs in
    the all-reduce's completion callback (on the communication thread, while backward goes on
    with earlier layers, whose parameters it does not touch); DDP's finalisation waits for it.

    Args:
        ddp: the wrapped model (its process group is used).
        step_bucket: steps the given parameters with the given averaged gradients.
        stepping: whether this backward pass is a step boundary.

    Returns:
        The hook, for ``ddp.register_comm_hook(None, hook)``.
    """
    group = ddp.process_group

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        del state
        buffer = bucket.buffer()
        buffer.mul_(1.0 / dist.get_world_size(group))
        work = dist.all_reduce(buffer, group=group, async_op=True)
        assert work is not None
        steps = stepping()
        if steps:  # the bucket holds a copy of each local gradient now: free those at once
            for p, view in zip(bucket.parameters(), bucket.gradients(), strict=True):
                p.grad = view

        def averaged(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
            if steps:
                step_bucket(list(bucket.parameters()), list(bucket.gradients()))
            return fut.value()[0]

        done: torch.futures.Future[Tensor] = work.get_future().then(averaged)
        return done

    # DDP checks the annotations themselves, which ``from __future__ import annotations`` made
    # strings
    hook.__annotations__ = {
        "state": Any,
        "bucket": GradBucket,
        "return": torch.futures.Future[Tensor],
    }
    return hook
