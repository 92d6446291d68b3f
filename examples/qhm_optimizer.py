"""Recipe: run your own optimizer scripted (GIL-free) inside ``DistributedOptimizer``.

``DistributedOptimizer`` runs an optimizer as a TorchScript module on every worker when its class
has a functional counterpart in ``functional_optim_map``. For your own optimizer:

1. Write the ``torch.optim.Optimizer`` (here :class:`QHM`, quasi-hyperbolic momentum,
   https://arxiv.org/abs/1810.06801)::

       buf = momentum * buf + (1 - momentum) * grad
       param -= lr * (nu * buf + (1 - nu) * grad)

2. Write a TorchScript-compatible functional twin (:class:`FunctionalQHM`): constructed as
   ``FunctionalQHM(params, *args, **kwargs)`` with the optimizer's hyperparameters plus
   ``_allow_empty_param_list``; ``step(gradients)`` takes one gradient (or None) per parameter.
   Use ``typing.List``/``Optional``/``Dict``, no ``from __future__ import annotations``, no
   ``**kwargs`` and no closures in it, and update the parameters under ``torch.no_grad()``.
3. Register it: ``register_functional_optim(QHM, FunctionalQHM)`` (on the trainer; the workers
   import this module to build it), then ``DistributedOptimizer(QHM, rrefs, lr=...)``.

Launch the demo with::

    torchrun --nproc-per-node 2 examples/qhm_optimizer.py

Rank 1 owns a linear layer; rank 0 trains it over RPC with ``DistributedOptimizer(QHM)`` (the
scripted path) and checks it against the same layer trained locally with the eager :class:`QHM`.
"""

import os
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from torch import Tensor


def _check_hyperparameters(lr: float, momentum: float, nu: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if not 0.0 <= nu <= 1.0:
        raise ValueError(f"Invalid nu value: {nu}")


class QHM(torch.optim.Optimizer):
    """Quasi-hyperbolic momentum.

    Args:
        params: parameters or parameter groups to optimize.
        lr: learning rate.
        momentum: decay of the momentum buffer (``beta`` in the paper), in ``[0, 1)``.
        nu: weight of the momentum buffer against the plain gradient, in ``[0, 1]``.

    Raises:
        ValueError: if a hyperparameter is out of range.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.999,
        nu: float = 0.7,
    ) -> None:
        _check_hyperparameters(lr, momentum, nu)
        super().__init__(params, {"lr": lr, "momentum": momentum, "nu": nu})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Perform one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, nu = group["lr"], group["momentum"], group["nu"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                _qhm_update(param, param.grad, state["momentum_buffer"], lr, momentum, nu)
        return loss


def _qhm_update(
    param: Tensor, grad: Tensor, buf: Tensor, lr: float, momentum: float, nu: float
) -> None:
    """One QHM update of ``param`` in place (shared by both classes: same numerics)."""
    buf.mul_(momentum).add_(grad, alpha=1.0 - momentum)
    param.add_(buf.mul(nu).add(grad, alpha=1.0 - nu), alpha=-lr)


class FunctionalQHM:
    """TorchScript-compatible QHM taking explicit gradients (the functional twin of :class:`QHM`).

    Args:
        params: the parameters to optimize.
        lr: learning rate.
        momentum: decay of the momentum buffer, in ``[0, 1)``.
        nu: weight of the momentum buffer against the plain gradient, in ``[0, 1]``.
        _allow_empty_param_list: accept an empty ``params`` (as torch's functional optimizers).

    Raises:
        ValueError: if a hyperparameter is out of range or ``params`` is empty.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        momentum: float = 0.999,
        nu: float = 0.7,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_hyperparameters(lr, momentum, nu)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("optimizer got an empty parameter list")
        self.defaults: Dict[str, float] = {"lr": lr, "momentum": momentum, "nu": nu}
        self.param_group: Dict[str, List[Tensor]] = {"params": params}
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; a None gradient leaves its parameter alone.

        Raises:
            ValueError: if ``gradients`` and the parameters differ in length.
        """
        params = self.param_group["params"]
        if len(params) != len(gradients):
            raise ValueError(
                "the gradients passed in does not equal to the size of the parameters!"
                + f"Params length: {len(params)}. "
                + f"Gradients length: {len(gradients)}"
            )
        lr = self.defaults["lr"]
        momentum = self.defaults["momentum"]
        nu = self.defaults["nu"]
        with torch.no_grad():
            for i in range(len(params)):
                grad = gradients[i]
                if grad is not None:  # TorchScript refines Optional in an if, not after continue
                    param = params[i]
                    if param not in self.state:
                        self.state[param] = {"momentum_buffer": torch.zeros_like(param)}
                    buf = self.state[param]["momentum_buffer"]
                    _qhm_update(param, grad, buf, lr, momentum, nu)


def register() -> None:
    """Register :class:`FunctionalQHM` for :class:`QHM` (keeps an existing entry)."""
    from compat_api.utils import register_functional_optim

    register_functional_optim(QHM, FunctionalQHM)


# -- demo -----------------------------------------------------------------------------------------


def _make_layer(seed: int) -> Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def _forward(weight: Any, x: Tensor) -> Tensor:
    return torch.tanh(x @ weight.local_value())


def _demo_trainer(steps: int) -> None:
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc

    from compat_api.optimizer import DistributedOptimizer

    register()
    remote_weight = rpc.remote("worker1", _make_layer, args=(0,))
    local_weight = _make_layer(0)
    local_opt = QHM([local_weight], lr=0.1, momentum=0.9, nu=0.7)
    dist_opt = DistributedOptimizer(QHM, [remote_weight], lr=0.1, momentum=0.9, nu=0.7)
    print(f"scripted on the worker: {dist_opt.is_functional_optim}")
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        with dist_autograd.context() as context_id:
            out = rpc.rpc_sync("worker1", _forward, args=(remote_weight, x))
            loss = (out - y).pow(2).mean()
            dist_autograd.backward(context_id, [loss])  # type: ignore[attr-defined]
            dist_opt.step(context_id)
        local_opt.zero_grad()
        (torch.tanh(x @ local_weight) - y).pow(2).mean().backward()  # type: ignore[no-untyped-call]
        local_opt.step()
        print(f"step {step}: loss {loss.item():.4f}")
    same = torch.equal(remote_weight.to_here(), local_weight.detach())
    print(f"distributed QHM equals local QHM: {same}")


def main() -> None:
    """torchrun entry point: rank 0 trains, rank 1 owns the layer."""
    from torch.distributed import rpc

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)  # type: ignore[no-untyped-call]
    if rank == 0:
        _demo_trainer(steps=5)
    rpc.shutdown()


if __name__ == "__main__":
    main()
