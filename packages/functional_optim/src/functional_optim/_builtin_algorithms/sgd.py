"""The built-in entries of the plain-gradient family: SGD (with momentum), ASGD and Muon."""

from __future__ import annotations

from collections.abc import Mapping

from functional_optim import kernels
from functional_optim._algorithm import Algorithm
from functional_optim._aliases._kernel_spec import GRADS, IMPL, LR, PARAMS, state
from functional_optim._aliases.asgd import asgd
from functional_optim._aliases.muon import muon
from functional_optim._aliases.sgd import sgd
from functional_optim._transforms.asgd import ScaleByAsgdState, scale_by_asgd
from functional_optim._transforms.momentum import TraceState, trace
from functional_optim._transforms.muon import ScaleByMuonState, check_muon_inputs, scale_by_muon
from functional_optim.functional import FunctionalASGD, FunctionalMuon, FunctionalSGD

__all__ = ["ASGD", "MUON", "SGD", "TRACE_NAMES"]

#: torch's key of :class:`TraceState`'s buffer (SGD's, and RMSprop's momentum).
TRACE_NAMES: dict[type, Mapping[str, str]] = {TraceState: {"momentum_buffer": "momentum_buffer"}}

#: The entry mirroring torch.optim.SGD.
SGD = Algorithm(
    name="sgd",
    torch_name="SGD",
    elementwise=True,
    alias=sgd,
    transform=trace,
    state_type=TraceState,
    state_names=TRACE_NAMES,
    kernel=kernels.sgd,
    kernel_args=(
        PARAMS, GRADS, state("momentum_buffer", when="momentum", fill="kernel"),
        LR, "momentum", "dampening", "weight_decay", "nesterov", "maximize", IMPL,
    ),
    functional=FunctionalSGD,
    has_fused=True,
    takes_sparse=True,
    promotes=True,
)  # fmt: skip

#: The entry mirroring torch.optim.ASGD.
ASGD = Algorithm(
    name="asgd",
    torch_name="ASGD",
    elementwise=True,
    alias=asgd,
    transform=scale_by_asgd,
    state_type=ScaleByAsgdState,
    state_names={ScaleByAsgdState: {"count": "step", "eta": "eta", "mu": "mu", "ax": "ax"}},
    kernel=kernels.asgd,
    kernel_args=(
        PARAMS, GRADS, state("ax"), state("mu", shape="scalar"),
        state("eta", shape="scalar"), state("count"),
        "lambd", LR, "t0", "alpha", "weight_decay", "maximize", IMPL,
    ),
    functional=FunctionalASGD,
    promotes=True,
)  # fmt: skip

#: The entry mirroring torch.optim.Muon.
MUON = Algorithm(
    name="muon",
    torch_name="Muon",
    alias=muon,
    transform=scale_by_muon,
    state_type=ScaleByMuonState,
    state_names={ScaleByMuonState: {"momentum_buffer": "momentum_buffer"}},
    kernel=kernels.muon,
    kernel_args=(
        PARAMS, GRADS, state("momentum_buffer"), LR, "weight_decay", "momentum",
        "nesterov", "ns_coefficients", "ns_steps", "eps", "adjust_lr_fn", IMPL,
    ),
    check_inputs=check_muon_inputs,
    functional=FunctionalMuon,
)  # fmt: skip
