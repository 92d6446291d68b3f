"""``torch.compile`` of one optimizer per family on the device, within 1e-6 of eager.

Each family's ``FunctionalX`` (multi-tensor path, as torch compiles its own optimizers) is
stepped eagerly and through ``torch.compile`` (inductor on CUDA; ``aot_eager`` in a CPU dry
run, which traces the same graph without inductor's minutes of C++ compiles here). The compile
time of the first compiled step is printed, and appended to ``$FO_REPORT_DIR/compile.tsv`` when
that variable is set (the device run collects it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from functional_optim.functional import (
    FunctionalAdafactor,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
)
from tests.functional_optim._parity import clone_tensors, make_grads, make_params

from ._device import DEVICE, MARKS

pytestmark = [*MARKS, pytest.mark.compile]

BACKEND = "inductor" if DEVICE.type == "cuda" else "aot_eager"
SHAPES = ((64, 32), (32,), (16, 16, 4), (7,))
#: family -> (class, hyperparameters)
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "adam": (FunctionalAdam, {"lr": 0.01, "weight_decay": 0.1}),
    "sgd-momentum": (FunctionalSGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "rmsprop": (FunctionalRMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    "adagrad": (FunctionalAdagrad, {"lr": 0.05}),
    "rprop": (FunctionalRprop, {"lr": 0.01}),
    "adafactor": (FunctionalAdafactor, {"lr": 0.05}),
}


def _record(family: str, seconds: float) -> None:
    print(f"compile {family} ({BACKEND}, {DEVICE.type}): {seconds:.1f} s")
    folder = os.environ.get("FO_REPORT_DIR")
    if folder:
        with (Path(folder) / "compile.tsv").open("a") as out:
            out.write(f"{family}\t{BACKEND}\t{DEVICE.type}\t{seconds:.2f}\n")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_step_matches_eager(family: str) -> None:
    cls, hyper = FAMILIES[family]
    params = [p.to(DEVICE) for p in make_params(SHAPES)]
    grads = [[g.to(DEVICE) for g in row] for row in make_grads(params, 4)]  # type: ignore[union-attr]
    eager_params = [p.clone() for p in params]
    eager = cls(eager_params, foreach=True, **hyper)
    compiled_params = [p.clone() for p in params]
    compiled_opt = cls(compiled_params, foreach=True, **hyper)
    torch._dynamo.reset()
    step = torch.compile(compiled_opt.step, backend=BACKEND)
    for i, row in enumerate(grads):
        eager.step(clone_tensors(row))
        start = time.perf_counter()
        step(clone_tensors(row))
        if i == 0:
            _record(family, time.perf_counter() - start)
    for ours, reference in zip(compiled_params, eager_params, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert not torch.equal(compiled_params[0], params[0]), "the compiled step changed nothing"
