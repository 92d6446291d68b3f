"""torchft 0.2.0's ``torchft.local_sgd.DiLoCo`` as a method of ``lm_diloco.py`` (a peer).

Each rank is one torchft replica group of one process: its own ``TCPStore``, a torchft
``ProcessGroupGloo`` and a ``Manager`` (synchronous quorum, ``min_replica_size`` = the world
size), all joined through one lighthouse that rank 0 starts (``LighthouseServer``) and whose
address it broadcasts over the benchmark's gloo group. ``DiLoCo`` hooks the inner optimizer:
every ``sync_every`` steps it all-reduces the pseudo-gradients (one call per parameter) and
runs the outer ``torch.optim.SGD``. Bytes: the tensors handed to ``Manager.allreduce``, counted
like the other methods' all-reduces; the quorum and commit RPCs to the lighthouse and the
managers are not payload (they carry no model data). ``init_sync=False``: every replica starts
from the same weights, as the other methods do (no initial healing transfer).

Private to the benchmarks (``_``-prefixed); torchft is optional: importing it raises
ImportError, which ``lm_diloco.py`` reports as a skipped row.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

TIMEOUT = timedelta(seconds=120)


class TorchftDiLoCo:
    """torchft's DiLoCo around a model, built on every rank at the same time.

    Args:
        model: the model (one fragment).
        period: ``sync_every``.
        outer_lr: the outer SGD's lr.
        momentum: its momentum.
        nesterov: Nesterov momentum.
        count: called with every tensor handed to ``Manager.allreduce`` (the byte counter).
    """

    def __init__(
        self,
        model: nn.Module,
        period: int,
        outer_lr: float,
        momentum: float,
        nesterov: bool,
        count: Callable[[torch.Tensor], None],
    ) -> None:
        import torch.distributed as dist
        from torchft._torchft import LighthouseServer
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.module = model
        self._period = period
        self._outer_args = (outer_lr, momentum, nesterov)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self._lighthouse = (
            LighthouseServer(bind="[::]:0", min_replicas=world_size) if rank == 0 else None
        )
        address = [self._lighthouse.address() if self._lighthouse is not None else None]
        dist.broadcast_object_list(address, src=0)
        self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=TIMEOUT),
            min_replica_size=world_size,
            use_async_quorum=False,
            load_state_dict=self._load,
            state_dict=self._save,
            replica_id=f"replica{rank}",
            store_addr="localhost",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=address[0],
            timeout=TIMEOUT,
            quorum_timeout=TIMEOUT,
            connect_timeout=TIMEOUT,
            init_sync=False,
        )
        allreduce = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            count(tensor)
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted  # type: ignore[method-assign]
        self._diloco: Any = None
        self._inner: torch.optim.Optimizer | None = None

    def _load(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])

    def _save(self) -> dict[str, Any]:
        return {"model": self.module.state_dict()}

    def make_inner(self, params: list[nn.Parameter], config: Any) -> torch.optim.Optimizer:
        """The same inner AdamW as the other methods."""
        return torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def before_step(self, params: list[nn.Parameter]) -> None:
        """Nothing before the inner step."""

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Enter torchft's DiLoCo around ``optimizer`` (its step hooks run the syncs)."""
        from torchft.local_sgd import DiLoCo

        lr, momentum, nesterov = self._outer_args
        outer = torch.optim.SGD(
            self.module.parameters(), lr=lr, momentum=momentum, nesterov=nesterov
        )
        self._diloco = DiLoCo(
            self.manager,
            [self.module],
            optimizer,
            outer,
            sync_every=self._period,
            backup_device=torch.device("cpu"),
            pin_memory=False,
        )
        self._diloco.__enter__()
        return optimizer

    def after_step(self, params: list[nn.Parameter]) -> None:
        """Nothing: torchft syncs from the optimizer's step hook."""

    def finish(self, params: list[nn.Parameter]) -> None:
        """Leave DiLoCo and shut the manager, store and lighthouse down."""
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()

    def own_count(self) -> int | None:
        return None
