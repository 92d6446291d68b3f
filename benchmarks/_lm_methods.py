"""The methods ``lm_diloco.py`` compares, and how it counts their bytes.

Each method is an object with the same small interface (``module``, ``make_inner``, ``wrap``,
``before_step``, ``after_step``, ``finish``, ``own_count``); ``make_method`` builds one by name
from ``lm_diloco.Config`` and the method's options in ``lm_diloco.METHODS``. torchft's peer has
the same interface (``_torchft_peer.py``). Private to the benchmarks (``_``-prefixed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

Config = Any  # lm_diloco.Config (not imported: lm_diloco imports this module)


# -- byte accounting ------------------------------------------------------------------------------


class CollectiveCounter:
    """Counts what this rank hands to ``dist.all_reduce`` and the all-gathers, while installed.

    ``payload`` is the bytes of the tensors this rank contributes. ``wire`` models what a ring
    sends per rank: ``2 (n - 1) / n`` times the payload for an all-reduce, ``n - 1`` times it
    for an all-gather (every other rank needs this rank's whole payload). A method that swaps an
    all-reduce for an all-gather (compressed DiLoCo) saves less on the wire than in payload.
    """

    _WRAPPED = ("all_reduce", "all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._originals: dict[str, Callable[..., Any]] = {}
        self.payload = 0
        self.wire = 0.0
        self.counting = True

    def _add(self, tensor: torch.Tensor, wire_factor: float) -> None:
        if self.counting:
            size = tensor.numel() * tensor.element_size()
            self.payload += size
            self.wire += wire_factor * size

    def add(self, tensor: torch.Tensor, allreduce: bool) -> None:
        """Count a tensor handed to a collective outside ``torch.distributed`` (torchft's)."""
        n = self._dist.get_world_size()
        self._add(tensor, 2 * (n - 1) / n if allreduce else n - 1)

    def install(self) -> None:
        """Wrap the collectives (module attributes: DDP's default hooks and ours look them up)."""
        dist = self._dist
        n = dist.get_world_size()
        self._originals = {name: getattr(dist, name) for name in self._WRAPPED}
        all_reduce = self._originals["all_reduce"]
        gather_single = self._originals["all_gather_single"]
        gather_into = self._originals["all_gather_into_tensor"]

        def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._add(tensor, 2 * (n - 1) / n)
            return all_reduce(tensor, *args, **kwargs)

        def counted_gather_single(out: torch.Tensor, mine: torch.Tensor, *a: Any, **k: Any) -> Any:
            self._add(mine, n - 1)
            return gather_single(out, mine, *a, **k)

        def counted_gather_into(out: torch.Tensor, mine: torch.Tensor, *a: Any, **k: Any) -> Any:
            self._add(mine, n - 1)
            return gather_into(out, mine, *a, **k)

        dist.all_reduce = counted_all_reduce
        dist.all_gather_single = counted_gather_single
        dist.all_gather_into_tensor = counted_gather_into

    def uninstall(self) -> None:
        """Put the original collectives back."""
        for name, original in self._originals.items():
            setattr(self._dist, name, original)


# -- methods --------------------------------------------------------------------------------------


class _Method:
    """How one method trains: the module to call and what follows each inner step."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def make_inner(self, params: list[nn.Parameter], config: Config) -> torch.optim.Optimizer:
        """The inner optimizer: AdamW (MuLoCo: Muon + AdamW)."""
        return torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to step (post-local SGD wraps the inner one)."""
        return optimizer

    def before_step(self, params: list[nn.Parameter]) -> None:
        """Called between ``backward()`` and the inner step (the warm start's gradients)."""

    def after_step(self, params: list[nn.Parameter]) -> None:
        """Called after every inner optimizer step."""

    def finish(self, params: list[nn.Parameter]) -> None:
        """Called once after the last inner step."""

    def own_count(self) -> int | None:
        """The bytes the method's own counter reports, if it keeps one."""
        return None


class _DDP(_Method):
    """Gradients all-reduced every step by DDP's default ``allreduce_hook`` (one per bucket)."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        # Registered explicitly so that each bucket goes through dist.all_reduce (counted); it
        # is the hook DDP's built-in all-reduce is equivalent to.
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        super().__init__(ddp)


class _PostLocalSGD(_Method):
    """Local AdamW steps in ``PostLocalSGDOptimizer``, parameters averaged every ``period``."""

    def __init__(self, model: nn.Module, period: int) -> None:
        super().__init__(model)
        self.period = period

    def wrap(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        from compat_api.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from compat_api.post_localSGD_optimizer import PostLocalSGDOptimizer

        # No DDP warm-up: averaging from the first step, on DiLoCo's schedule.
        return PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(self.period))


class _DiLoCo(_Method):
    """``DiLoCoAverager`` after every inner step."""

    def __init__(self, model: nn.Module, averager: Any, overlap: bool = False) -> None:
        super().__init__(model)
        self.averager = averager
        self.overlap = overlap

    def after_step(self, params: list[nn.Parameter]) -> None:
        self.averager.average_parameters(params)

    def finish(self, params: list[nn.Parameter]) -> None:
        if self.overlap:
            # The fragment sent at the last step is still in flight: one more call (no inner
            # step, nothing sent) waits for it and applies it, as the next step would have.
            self.averager.average_parameters(params)

    def own_count(self) -> int | None:
        return int(self.averager.bytes_communicated)


class _WarmStart(_DiLoCo):
    """``WarmStartDiLoCoAverager``: its gradient mean before each warm-start step."""

    def before_step(self, params: list[nn.Parameter]) -> None:
        self.averager.average_gradients(params)


def _muon_kwargs(model: nn.Module, config: Config) -> dict[str, Any]:
    """MuLoCo's inner optimizer: Muon on the weight matrices (not the embeddings), AdamW else."""
    embeddings = {id(p) for p in (model.embed.weight, model.position)}
    return {
        "lr": config.lr,
        "weight_decay": 0.1,
        "betas": (0.9, 0.95),
        "use_muon": lambda p: p.ndim == 2 and id(p) not in embeddings,
    }


class _DDPMuon(_DDP):
    """DDP with MuLoCo's inner optimizer: the baseline that isolates what Muon alone gives."""

    def make_inner(self, params: list[nn.Parameter], config: Config) -> torch.optim.Optimizer:
        from compat_api.algorithms.model_averaging import MuonAdamW

        return MuonAdamW(params, **_muon_kwargs(self.module.module, config))


class _MuLoCo(_DiLoCo):
    """``muloco()``: the start copy's ``DiLoCoAverager`` around Muon + AdamW inner steps."""

    def __init__(self, model: nn.Module, config: Config, outer: Any) -> None:
        from compat_api.algorithms.model_averaging import muloco

        inner, averager = muloco(
            model.parameters(), period=config.period, outer=outer, **_muon_kwargs(model, config)
        )
        super().__init__(model, averager)
        self.inner = inner

    def make_inner(self, params: list[nn.Parameter], config: Config) -> torch.optim.Optimizer:
        return self.inner


def make_method(
    name: str,
    model: nn.Module,
    config: Config,
    options: dict[str, Any] | None,
    count: Callable[[torch.Tensor], None],
) -> _Method:
    """The method ``name`` around ``model``; ``count`` gets torchft's all-reduced tensors."""
    if name == "DDP":
        return _DDP(model)
    if name == "DDP + Muon":
        return _DDPMuon(model)
    if name == "post-local SGD":
        return _PostLocalSGD(model, config.period)
    nesterov = config.nesterov and config.outer_momentum > 0
    if name == "torchft DiLoCo":
        from _torchft_peer import TorchftDiLoCo

        peer = TorchftDiLoCo(
            model,
            config.period,
            config.outer_lr,
            config.outer_momentum,
            nesterov,
            count,
        )
        return peer  # type: ignore[return-value]  # the same interface
    import functional_optim as fo
    from compat_api.algorithms.model_averaging import (
        DiLoCoAverager,
        SparseLoCoAverager,
        WarmStartDiLoCoAverager,
    )

    outer = fo.sgd(lr=config.outer_lr, momentum=config.outer_momentum, nesterov=nesterov)
    if name == "MuLoCo":
        return _MuLoCo(model, config, outer)
    if name == "DiLoCo + warm start":
        averager = WarmStartDiLoCoAverager(
            outer, period=config.period, warm_start_steps=config.warm_start
        )
        return _WarmStart(model, averager)
    # The start copy (``params=``): every rank holds the same initial weights, so no
    # initial average; the first outer sync comes one period after step 1.
    if name.startswith("SparseLoCo"):
        config = replace(config, **(options or {}))
        averager = SparseLoCoAverager(
            fo.sgd(lr=config.sparse_outer_lr),
            period=config.period,
            density=config.density,
            bits=config.bits,
            feedback_decay=config.feedback_decay,
            params=model.parameters(),
        )
        return _DiLoCo(model, averager)
    options = dict(options or {})
    if name.startswith("Streaming"):
        options["fragments"] = config.fragments
    averager = DiLoCoAverager(outer, period=config.period, params=model.parameters(), **options)
    return _DiLoCo(model, averager, overlap=bool(options.get("overlap")))
