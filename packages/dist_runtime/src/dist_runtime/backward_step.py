"""Optimizer in backward: step each parameter as soon as its gradient is final, then free it.

:func:`optimizer_in_backward` gives every parameter its own optimizer and steps it from the
parameter's post-accumulate-grad hook (DDP: from a communication hook once the bucket is
averaged; FSDP2: from the hook FSDP2 calls after the reduce-scatter; see
:mod:`dist_runtime.backward_step_wrappers`), then sets ``.grad`` to ``None``. Peak memory drops
by up to the gradients' size (they never all exist at once) for a plain module and FSDP2; under
DDP the buckets stay (a gradient-sized buffer): the local gradients are freed as soon as their
bucket holds them, which ``gradient_as_bucket_view=True`` achieves without this
(``docs/optimizer_in_backward.md`` has the numbers).

Gradient accumulation: with ``accumulation_steps=k`` gradients accumulate in ``.grad`` for
``k - 1`` backward passes and the ``k``-th steps. Run each micro-batch's backward inside
``with handle.micro_batch():`` (required for ``no_sync`` semantics under DDP/FSDP2: the first
``k - 1`` are not synchronised); without it, the handle counts backward passes itself.

Clipping by global norm needs every gradient before any step:

* ``clip_mode="two_pass"``: gradients are kept until backward ends, then the global norm is
  computed, gradients clipped and every parameter stepped -- exactly ``clip_grad_norm_`` +
  ``step``, but no memory win (``benchmarks/backward_step_memory.py`` measures it).
* ``clip_mode="previous"``: step ``t``'s gradients are multiplied by
  ``min(1, max_norm / (N[t-1] + 1e-6))``, where ``N[t-1]`` is the 2-norm of step ``t - 1``'s
  *unclipped* gradients (after averaging/accumulation); step 0 is not clipped. Cheap (one norm
  per parameter) and approximate: a spike is clipped one step late.

Example::

    >>> handle = optimizer_in_backward(model, fo.adamw(1e-3), accumulation_steps=2)
    >>> for batch in micro_batches:
    ...     with handle.micro_batch():
    ...         loss_fn(model(batch)).backward()     # steps on every 2nd backward
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from dist_runtime.backward_step_checks import (
    ClipMode,
    OptimizerFactory,
    build_optimizer,
    check_options,
    claim,
    is_claimed,
    named_params,
    release,
)
from dist_runtime.backward_step_wrappers import (
    ddp_step_hook,
    gradient_sync,
    local_grad,
    sum_across_shards,
    wrapper_kind,
)
from functional_optim import GradientTransformation

__all__ = ["ClipMode", "OptimizerFactory", "OptimizerInBackward", "optimizer_in_backward"]


class OptimizerInBackward:
    """The hooks that step parameters inside backward; made by :func:`optimizer_in_backward`.

    Attributes:
        names: each parameter's name (FQN for a module, position for a list).
        params: the parameters, in ``names`` order.
        optimizers: one optimizer per parameter, in the same order.
        accumulation_steps: backward passes per optimizer step.
    """

    def __init__(
        self,
        model_or_params: Any,
        make_optimizer: OptimizerFactory,
        accumulation_steps: int,
        clip_grad_norm: float | None,
        clip_mode: ClipMode,
    ) -> None:
        check_options(accumulation_steps, clip_grad_norm, clip_mode)
        if not isinstance(make_optimizer, GradientTransformation) and not callable(make_optimizer):
            raise TypeError(
                "make_optimizer must be a callable (params -> Optimizer) or a "
                f"GradientTransformation, got {type(make_optimizer).__name__}"
            )
        named = named_params(model_or_params)
        seen: set[int] = set()
        for name, p in named:
            if id(p) in seen:
                raise ValueError(f"param {name} appears twice in the parameter list")
            if is_claimed(p):
                raise ValueError(f"param {name} already steps in backward (another handle)")
            seen.add(id(p))
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.optimizers = [build_optimizer(make_optimizer, p, n) for n, p in named]
        self.accumulation_steps = accumulation_steps
        self._model = model_or_params if isinstance(model_or_params, nn.Module) else None
        self._kind = wrapper_kind(model_or_params)
        self._max_norm = clip_grad_norm
        self._two_pass = clip_grad_norm is not None and clip_mode == "two_pass"
        self._previous = clip_grad_norm is not None and clip_mode == "previous"
        self._index = {id(p): i for i, p in enumerate(self.params)}
        # params that step from their own hook: all but DDP's (its comm hook steps those)
        ignored: set[str] = getattr(model_or_params, "parameters_to_ignore", set())
        self._hook_steps = {id(p) for n, p in named if self._kind != "ddp" or n in ignored}
        self._micro = 0
        self._in_context = False
        self._armed = False
        self._norms: dict[int, Tensor] = {}
        self._last_norm: Tensor | None = None
        self._coef: Tensor | None = None
        self.removed = False
        self._hooks: list[Any] = []
        if self._kind == "ddp":  # first: it raises when the model already has a comm hook
            me = weakref.ref(self)
            hook = ddp_step_hook(
                model_or_params,
                lambda ps, gs: _call(me, "_step_bucket", ps, gs),
                lambda: bool(_call(me, "_comm_steps")),
            )
            model_or_params.register_comm_hook(None, hook)
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))  # type: ignore[no-untyped-call]
            claim(p, self)

    # -- accumulation ------------------------------------------------------------------------
    @property
    def step_boundary(self) -> bool:
        """Whether the next backward pass steps (the last micro-batch of an accumulation)."""
        return self._micro == self.accumulation_steps - 1

    @property
    def last_grad_norm(self) -> Tensor | None:
        """The global 2-norm of the last step's unclipped gradients (clipping modes only)."""
        return self._last_norm

    @contextlib.contextmanager
    def micro_batch(self) -> Iterator[None]:
        """Run one micro-batch's backward; off the step boundary, gradient synchronisation is
        off (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``). The micro-batch
        count advances when the block exits without an exception.

        Raises:
            RuntimeError: the contexts are nested, or the handle was removed.
        """
        if self.removed:
            raise RuntimeError("this optimizer_in_backward handle was removed")
        if self._in_context:
            raise RuntimeError("micro_batch() contexts cannot be nested")
        self._in_context = True
        self._armed = False  # a backward that raised never ran its end-of-backward callback
        try:
            with gradient_sync(self._model, self._kind, self.step_boundary):
                yield
        finally:
            self._in_context = False
        self._micro = (self._micro + 1) % self.accumulation_steps

    # -- hooks -------------------------------------------------------------------------------
    def _comm_steps(self) -> bool:
        return not self.removed and not self._two_pass and self.step_boundary

    def _on_grad(self, p: Tensor) -> None:
        if self.removed:
            return
        if not self._armed:  # once per backward: run _after_backward once it (and DDP's or
            self._armed = True  # FSDP2's own end-of-backward callback) finished
            Variable._execution_engine.queue_callback(
                lambda: Variable._execution_engine.queue_callback(self._after_backward)
            )
        if id(p) in self._hook_steps and not self._two_pass and self.step_boundary:
            self._step(self._index[id(p)], p, p.grad)

    def _step_bucket(self, params: list[Tensor], grads: list[Tensor]) -> None:
        for p, grad in zip(params, grads, strict=True):
            i = self._index.get(id(p))
            if i is not None:
                self._step(i, p, grad)

    @torch.no_grad()
    def _step(self, i: int, p: Tensor, grad: Tensor | None) -> None:
        if grad is None:
            return
        if self._previous:
            local = local_grad(grad)
            self._norms[i] = torch.linalg.vector_norm(local, 2.0)
            if self._coef is not None:
                local.mul_(self._coef)
        if p.grad is not grad:
            p.grad = grad
        self.optimizers[i].step()
        if self._kind != "ddp":  # DDP: a bucket view, that DDP's finalisation copies into;
            p.grad = None  # _after_backward drops it (freeing it now would reallocate it)

    def _after_backward(self) -> None:
        self._armed = False
        if self.step_boundary:
            if self._two_pass:
                self._clip_and_step_all()
            elif self._previous:
                self._finish_norm()
            if self._kind == "ddp":  # the bucket views the comm hook made the gradients
                for p in self.params:
                    p.grad = None
        if not self._in_context:
            self._micro = (self._micro + 1) % self.accumulation_steps

    @torch.no_grad()
    def _clip_and_step_all(self) -> None:
        assert self._max_norm is not None
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in with_grad]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        total = nn.utils.get_total_norm(grads, 2.0, False, None)
        nn.utils.clip_grads_with_norm_(params, self._max_norm, total, None)
        full = getattr(total, "full_tensor", None)
        self._last_norm = full() if full is not None else total
        for i in with_grad:
            self.optimizers[i].step()
            self.params[i].grad = None

    def _finish_norm(self) -> None:
        assert self._max_norm is not None
        if not self._norms:
            return
        norms = torch.stack([self._norms[i] for i in sorted(self._norms)])
        total = torch.linalg.vector_norm(norms, 2.0)
        if self._kind == "fsdp2":  # each rank has the norms of its shards
            total = sum_across_shards(total.square(), self.params).sqrt()
        self._norms.clear()
        self._last_norm = total
        self._coef = torch.clamp(self._max_norm / (total + 1e-6), max=1.0)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every optimizer's ``state_dict()`` keyed by parameter name, the micro-batch position
        and (clip mode ``"previous"``) the last step's gradient norm.

        Returns:
            ``{"accumulation_steps", "micro_batch", "last_grad_norm", "optimizers"}``.
        """
        return {
            "accumulation_steps": self.accumulation_steps,
            "micro_batch": self._micro,
            "last_grad_norm": None if self._last_norm is None else self._last_norm.clone(),
            "optimizers": {n: o.state_dict() for n, o in zip(self.names, self.optimizers)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; its shape is checked before anything is loaded.

        Args:
            state_dict: from :meth:`state_dict` of a handle over the same parameter names.

        Raises:
            KeyError: a top-level entry is missing.
            ValueError: other parameter names or another ``accumulation_steps``; each
                optimizer's own ``load_state_dict`` errors.
        """
        optimizers = state_dict["optimizers"]
        steps, micro = state_dict["accumulation_steps"], state_dict["micro_batch"]
        norm = state_dict["last_grad_norm"]
        if set(optimizers) != set(self.names):
            missing, extra = set(self.names) - set(optimizers), set(optimizers) - set(self.names)
            raise ValueError(
                f"loaded state has other parameters: missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        if steps != self.accumulation_steps or not (isinstance(micro, int) and 0 <= micro < steps):
            raise ValueError(
                f"loaded state is for accumulation_steps={steps} (micro-batch {micro}), this "
                f"handle has accumulation_steps={self.accumulation_steps}"
            )
        if norm is not None and not isinstance(norm, Tensor):
            raise ValueError(f"last_grad_norm must be a Tensor or None, got {type(norm)}")
        for name, optimizer in zip(self.names, self.optimizers, strict=True):
            optimizer.load_state_dict(optimizers[name])
        self._micro = micro
        self._last_norm = None if norm is None else norm.clone()
        self._coef = None
        if self._previous and self._last_norm is not None:
            assert self._max_norm is not None
            self._coef = torch.clamp(self._max_norm / (self._last_norm + 1e-6), max=1.0)

    def remove(self) -> None:
        """Remove the hooks: later backward passes leave ``.grad`` for an ordinary step. Under
        DDP the communication hook stays registered (DDP cannot unregister it) and only
        averages, as DDP's own reduction does."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.removed = True
        for p in self.params:
            release(p)


def _call(ref: weakref.ref[OptimizerInBackward], method: str, *args: Any) -> Any:
    handle = ref()
    return None if handle is None else getattr(handle, method)(*args)


def optimizer_in_backward(
    model_or_params: nn.Module | Iterable[Tensor],
    make_optimizer: OptimizerFactory,
    *,
    accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    clip_mode: ClipMode = "previous",
) -> OptimizerInBackward:
    """Step every parameter inside backward, as soon as its (averaged) gradient is final.

    Args:
        model_or_params: a module (plain, ``DistributedDataParallel`` or FSDP2
            ``fully_shard``-ed; its trainable parameters) or an iterable of leaf tensors
            (plain autograd only: under DDP pass the DDP module, or the step sees gradients
            before they are averaged).
        make_optimizer: ``params -> torch.optim.Optimizer`` (or a ``GradientTransformation``,
            or a callable returning one), called once per parameter with ``[param]``. A
            transform that couples parameters (e.g. a global-norm clip inside ``chain``) sees
            one parameter at a time; use ``clip_grad_norm`` instead.
        accumulation_steps: backward passes per optimizer step (see :meth:`micro_batch`).
        clip_grad_norm: clip gradients to this global 2-norm (``None``: no clipping).
        clip_mode: ``"two_pass"`` (exact, keeps all gradients) or ``"previous"`` (clips with
            the previous step's norm; see the module docstring).

    Returns:
        The handle (``.optimizers``, ``.state_dict()``, ``.micro_batch()``, ``.remove()``).

    Raises:
        TypeError: ``model_or_params`` holds a non-Tensor; ``make_optimizer`` is neither
            callable nor a transform, or returns something else; a non-int
            ``accumulation_steps`` or non-number ``clip_grad_norm``.
        ValueError: ``accumulation_steps < 1``; an unknown ``clip_mode``; a non-positive
            ``clip_grad_norm``; a parameter that does not require grad, is not a leaf, appears
            twice or already steps in another live handle; an LBFGS-style optimizer.
        RuntimeError: the DDP model already has a communication hook (DDP's error).
    """
    return OptimizerInBackward(
        model_or_params, make_optimizer, accumulation_steps, clip_grad_norm, clip_mode
    )
