"""``torch.compile`` of ``fo.Optimizer.step`` and of a whole train step, against eager.

The kernels pick torch's per-tensor maths under compile (torch's fused CPU kernels have no fake
implementation AOT autograd can trace) and read step counts as tensors (no ``.item()`` graph
break), so the step compiles into graphs instead of falling back to eager: each test counts
the graphs dynamo produced and the ops in them. ``aot_eager`` traces what inductor traces, at
a fraction of the compile time.

The default run covers the aliases the issue names (Adam, AdamW, SGD) and a chain; every
other alias is in the ``compile_matrix`` set, run by ``nox -s compile``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import functional_optim as fo

from ._alias_registry import CASE_TABLES
from .test_optax_aliases import CASES as OPTAX_CASES

Make = Callable[[], fo.GradientTransformation]

#: Closure-driven (LBFGS) or sparse-only (SparseAdam) algorithms have no compiled train step.
_NOT_COMPILED = {"lbfgs", "sparse_adam"}


def _torch_named() -> dict[str, Make]:
    return {
        name: (lambda name=name, base=base: getattr(fo, name)(**base))
        for name, (base, _) in CASE_TABLES.items()
        if name not in _NOT_COMPILED and hasattr(fo, name)
    }


DEFAULT: dict[str, Make] = {
    "adam": lambda: fo.adam(lr=1e-2),
    "adamw": lambda: fo.adamw(lr=1e-2, weight_decay=0.1),
    "sgd": lambda: fo.sgd(lr=0.05, momentum=0.9, nesterov=True),
    "chain(clip, adamw)": lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=1e-2)),
}
MATRIX: dict[str, Make] = {
    **{f"torch:{k}": v for k, v in _torch_named().items()},
    **{f"optax:{k}": v[0] for k, v in OPTAX_CASES.items()},
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # no biases: Muon takes matrices only
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False)
    )


def _check(name: str, make: Make, steps: int = 3) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    eager_model, compiled_model, step_model = _model(), _model(), _model()
    eager = fo.Optimizer(eager_model.parameters(), make())
    compiled = fo.Optimizer(compiled_model.parameters(), make())
    stepped = fo.Optimizer(step_model.parameters(), make())

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()

    torch._dynamo.reset()
    train_counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step_counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled_train = torch.compile(train, backend=train_counter)
    compiled_step = torch.compile(stepped.step, backend=step_counter)
    start = time.perf_counter()
    for _ in range(steps):
        train(eager_model, eager)
        compiled_train(compiled_model, compiled)
        stepped.zero_grad()
        step_model(x).pow(2).sum().backward()
        compiled_step()
    seconds = time.perf_counter() - start
    print(
        f"{name}: compile+{steps} steps {seconds:.1f} s; train step {train_counter.frame_count} "
        f"graphs / {train_counter.op_count} ops; opt.step {step_counter.frame_count} graphs / "
        f"{step_counter.op_count} ops"
    )
    assert step_counter.frame_count >= 1, "opt.step ran eagerly"
    assert step_counter.op_count > 0, "opt.step ran eagerly"
    assert train_counter.op_count > step_counter.op_count
    for model in (compiled_model, step_model):
        for a, b in zip(model.parameters(), eager_model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), _model().parameters()))


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(DEFAULT))
def test_compiled_step_and_train_step_match_eager(name: str) -> None:
    _check(name, DEFAULT[name])


@pytest.mark.compile_matrix
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_every_alias_compiles(name: str) -> None:
    _check(name, MATRIX[name])
