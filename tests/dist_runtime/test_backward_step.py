"""optimizer_in_backward against the ordinary step-after-backward (same optimizer, same batches).

Plain module, DDP and FSDP2 (2 gloo ranks, one world) without clipping: bitwise (each parameter's
update is the same elementwise arithmetic; DDP's average is the same scale-then-all-reduce;
FSDP2 calls the hooks with the reduce-scattered shard). clip_mode="two_pass" against
clip_grad_norm_ + step: bitwise (the same torch functions on the same gradients).
clip_mode="previous" against a reference that clips step t with step t-1's norm (torch's
get_total_norm + clip_grads_with_norm_): bitwise for a plain module and DDP; FSDP2 to 1e-6
relative (norms and params), as each rank's shard norms are summed in another order than
DTensor's norm.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import functional_optim as fo
from dist_runtime import optimizer_in_backward
from tests._world import World

STEPS = 4
CLIP = 0.3  # below the first steps' gradient norms (~0.44, 0.27, 0.33): clipping happens


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3, bias=False)
    )


def _batch(step: int, micro: int, rank: int = 0) -> Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(5, 6, generator=gen) * 3.0


def _loss(model: nn.Module, x: Tensor) -> Tensor:
    return model(x).square().mean()


MAKERS: dict[str, Any] = {
    "fo.adamw (transform)": fo.adamw(1e-2, weight_decay=0.1),
    "fo.sgd (callable)": lambda ps: fo.Optimizer(ps, fo.sgd(0.05, momentum=0.9)),
    "torch.optim.Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


def _reference_optimizer(make: Any, params: list[Tensor]) -> torch.optim.Optimizer:
    is_tx = isinstance(make, fo.GradientTransformation)
    return fo.Optimizer(params, make) if is_tx else make(params)  # type: ignore[no-any-return]


def _train_reference(
    model: nn.Module,
    make: Any,
    k: int,
    clip: float | None = None,
    clip_mode: str = "two_pass",
    rank: int = 0,
    no_sync: Callable[[], Any] | None = None,
) -> list[Tensor | None]:
    """Step-after-backward; returns each step's unclipped global gradient norm."""
    opt = _reference_optimizer(make, list(model.parameters()))
    previous: Tensor | None = None
    norms: list[Tensor | None] = []
    for step in range(STEPS):
        for micro in range(k):
            if no_sync is not None and micro < k - 1:
                with no_sync():
                    _loss(model, _batch(step, micro, rank)).backward()
            else:
                _loss(model, _batch(step, micro, rank)).backward()
        params = [p for p in model.parameters() if p.grad is not None]
        if clip is not None and clip_mode == "two_pass":
            norms.append(nn.utils.clip_grad_norm_(params, clip))
        elif clip is not None:
            total = nn.utils.get_total_norm([p.grad for p in params])
            if previous is not None:
                nn.utils.clip_grads_with_norm_(params, clip, previous)
            norms.append(total)
            previous = total
        opt.step()
        opt.zero_grad()
    return norms


def _train_in_backward(
    model: nn.Module, handle: Any, k: int, rank: int = 0, context: bool = True
) -> list[Tensor | None]:
    norms: list[Tensor | None] = []
    for step in range(STEPS):
        for micro in range(k):
            if context:
                with handle.micro_batch():
                    _loss(model, _batch(step, micro, rank)).backward()
            else:
                _loss(model, _batch(step, micro, rank)).backward()
        norms.append(handle.last_grad_norm)
    return norms


def _full(t: Tensor) -> Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _same(a: nn.Module, b: nn.Module, rtol: float = 0.0) -> bool:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        x, y = _full(p.detach()), _full(q.detach())
        if not (torch.equal(x, y) if rtol == 0.0 else torch.allclose(x, y, rtol=rtol, atol=0)):
            return False
    return True


# -- plain module ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("context", [True, False])
def test_plain_matches_step_after_backward(k: int, name: str, context: bool) -> None:
    make = MAKERS[name]
    model, reference = _model(), _model()
    handle = optimizer_in_backward(model, make, accumulation_steps=k)
    _train_in_backward(model, handle, k, context=context)
    _train_reference(reference, make, k)
    assert _same(model, reference)
    assert all(p.grad is None for p in model.parameters())
    handle.remove()


@pytest.mark.parametrize("k", [1, 2])
def test_two_pass_clip_equals_clip_grad_norm(k: int) -> None:
    model, reference = _model(), _model()
    make = MAKERS["fo.adamw (transform)"]
    handle = optimizer_in_backward(
        model, make, accumulation_steps=k, clip_grad_norm=CLIP, clip_mode="two_pass"
    )
    norms = _train_in_backward(model, handle, k)
    expected = _train_reference(reference, make, k, clip=CLIP, clip_mode="two_pass")
    assert _same(model, reference)
    assert all(torch.equal(a, b) for a, b in zip(norms, expected, strict=True))  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("k", [1, 2])
def test_previous_clip_equals_previous_norm_reference(k: int) -> None:
    model, reference = _model(), _model()
    make = MAKERS["fo.sgd (callable)"]
    handle = optimizer_in_backward(model, make, accumulation_steps=k, clip_grad_norm=CLIP)
    norms = _train_in_backward(model, handle, k)
    expected = _train_reference(reference, make, k, clip=CLIP, clip_mode="previous")
    assert _same(model, reference)
    assert all(torch.equal(a, b) for a, b in zip(norms, expected, strict=True))  # type: ignore[arg-type]
    # the clip really happened (else the test could not fail): unclipped training differs
    unclipped = _model()
    _train_reference(unclipped, make, k)
    assert not _same(model, unclipped)


def test_step_boundary_and_state_dict_round_trip() -> None:
    make = MAKERS["fo.adamw (transform)"]
    model, reference = _model(), _model()
    handle = optimizer_in_backward(model, make, accumulation_steps=2, clip_grad_norm=CLIP)
    assert not handle.step_boundary
    with handle.micro_batch():
        _loss(model, _batch(0, 0)).backward()
    assert handle.step_boundary
    with handle.micro_batch():
        _loss(model, _batch(0, 1)).backward()
    saved = copy.deepcopy(handle.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = optimizer_in_backward(resumed_model, make, accumulation_steps=2, clip_grad_norm=CLIP)
    resumed.load_state_dict(saved)
    handle.remove()
    _train_reference(reference, make, 2, clip=CLIP, clip_mode="previous")
    # continue the resumed run for steps 1..3 and compare with the uninterrupted reference
    for step in range(1, STEPS):
        for micro in range(2):
            with resumed.micro_batch():
                _loss(resumed_model, _batch(step, micro)).backward()
    assert _same(resumed_model, reference)
    with pytest.raises(ValueError, match="other parameters"):
        resumed.load_state_dict({**saved, "optimizers": {"x": {}}})
    with pytest.raises(ValueError, match="accumulation_steps"):
        resumed.load_state_dict({**saved, "accumulation_steps": 3})


def test_remove_restores_ordinary_gradients() -> None:
    model = _model()
    params = list(model.parameters())
    handle = optimizer_in_backward(params, fo.sgd(0.1))
    with pytest.raises(ValueError, match="another handle"):
        optimizer_in_backward(params[:1], fo.sgd(0.1))
    handle.remove()
    before = [p.detach().clone() for p in params]
    _loss(model, _batch(0, 0)).backward()
    assert all(p.grad is not None for p in params)
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    optimizer_in_backward(params, fo.sgd(0.1)).remove()  # claimable again


def _no_hooks(params: list[Tensor]) -> bool:
    return all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in params)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps must be >= 1"),
        ({"accumulation_steps": 1.5}, TypeError, "accumulation_steps must be an int"),
        ({"clip_mode": "exact"}, ValueError, "clip_mode must be one of"),
        ({"clip_grad_norm": -1.0}, ValueError, "positive and finite"),
        ({"clip_grad_norm": "1"}, TypeError, "clip_grad_norm must be a number"),
    ],
)
def test_bad_options_raise_before_registering(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    model = _model()
    with pytest.raises(error, match=match):
        optimizer_in_backward(model, fo.sgd(0.1), **kwargs)
    assert _no_hooks(list(model.parameters()))


def test_bad_params_raise_before_registering() -> None:
    params = list(_model().parameters())
    frozen = torch.zeros(3)
    with pytest.raises(ValueError, match="does not require grad"):
        optimizer_in_backward([*params, frozen], fo.sgd(0.1))
    with pytest.raises(ValueError, match="appears twice"):
        optimizer_in_backward([*params, params[0]], fo.sgd(0.1))
    with pytest.raises(ValueError, match="non-leaf"):
        optimizer_in_backward([params[0] * 2], fo.sgd(0.1))
    with pytest.raises(TypeError, match="iterable of Tensors"):
        optimizer_in_backward(params[0], fo.sgd(0.1))
    with pytest.raises(TypeError, match="can only step Tensors"):
        optimizer_in_backward([params[0], 3], fo.sgd(0.1))
    with pytest.raises(TypeError, match="must be a callable"):
        optimizer_in_backward(params, 0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must return a torch\.optim\.Optimizer"):
        optimizer_in_backward(params, lambda ps: None)
    with pytest.raises(ValueError, match="over exactly that param"):
        optimizer_in_backward(params, lambda ps: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="LBFGS"):
        optimizer_in_backward(params, lambda ps: torch.optim.LBFGS(ps))
    frozen_model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="without trainable parameters"):
        optimizer_in_backward(frozen_model, fo.sgd(0.1))
    assert _no_hooks(params)


# -- DDP and FSDP2 on 2 gloo ranks -------------------------------------------------------------
def _ddp_check(
    rank: int, world_size: int, k: int, clip: float | None, mode: str, bucket_view: bool
) -> bool:
    make = MAKERS["fo.adamw (transform)"]
    model = DistributedDataParallel(_model(), gradient_as_bucket_view=bucket_view)
    reference = DistributedDataParallel(_model(), gradient_as_bucket_view=bucket_view)
    handle = optimizer_in_backward(
        model, make, accumulation_steps=k, clip_grad_norm=clip, clip_mode=mode
    )  # type: ignore[arg-type]
    norms = _train_in_backward(model, handle, k, rank=rank)
    expected = _train_reference(
        reference, make, k, clip, mode, rank=rank, no_sync=reference.no_sync
    )
    same_norms = clip is None or all(
        torch.equal(a, b)  # type: ignore[arg-type]
        for a, b in zip(norms, expected, strict=True)
    )
    freed = all(p.grad is None for p in model.parameters())
    boundary_ok = handle.step_boundary == (k == 1)
    return _same(model.module, reference.module) and same_norms and freed and boundary_ok


def _ddp_extras_check(rank: int, world_size: int) -> list[str]:
    """Refusals, remove(), and a parameter DDP ignores; returns the failed checks."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    failed = []
    hooked = DistributedDataParallel(_model())
    hooked.register_comm_hook(None, allreduce_hook)
    try:
        optimizer_in_backward(hooked, fo.sgd(0.1))
        failed.append("second comm hook accepted")
    except RuntimeError:
        if not _no_hooks(list(hooked.parameters())):
            failed.append("hooks left after the comm-hook refusal")
    model, reference = DistributedDataParallel(_model()), DistributedDataParallel(_model())
    handle = optimizer_in_backward(model, fo.sgd(0.1))
    try:
        optimizer_in_backward(model, fo.sgd(0.1))
        failed.append("second handle accepted")
    except ValueError:
        pass
    handle.remove()  # the comm hook stays and only averages
    _loss(model, _batch(0, 0, rank)).backward()
    _loss(reference, _batch(0, 0, rank)).backward()
    if not all(
        torch.equal(p.grad, q.grad)  # type: ignore[arg-type]
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ):
        failed.append("gradients after remove() differ from DDP's")
    # a parameter DDP ignores steps on its local gradient, like step-after-backward
    modules = []
    for _ in range(2):
        inner = _model()
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(inner, ["4.weight"])
        modules.append(DistributedDataParallel(inner))
    make = MAKERS["fo.adamw (transform)"]
    handle = optimizer_in_backward(modules[0], make)
    _train_in_backward(modules[0], handle, 1, rank=rank)
    _train_reference(modules[1], make, 1, rank=rank)
    if not _same(modules[0], modules[1]):
        failed.append("ignored parameter")
    return failed


def _fsdp_model(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_check(
    rank: int, world_size: int, k: int, clip: float | None, mode: str, maker: str
) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    make = MAKERS[maker]
    model, reference = _fsdp_model(mesh), _fsdp_model(mesh)
    handle = optimizer_in_backward(
        model, make, accumulation_steps=k, clip_grad_norm=clip, clip_mode=mode
    )
    norms = _train_in_backward(model, handle, k, rank=rank)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        reference.set_requires_gradient_sync(False)  # type: ignore[operator]
        yield
        reference.set_requires_gradient_sync(True)  # type: ignore[operator]

    expected = _train_reference(reference, make, k, clip, mode, rank=rank, no_sync=no_sync)
    rtol = 0.0 if clip is None or mode == "two_pass" else 1e-6
    close_norms = clip is None or all(
        torch.allclose(_full(a), _full(b), rtol=1e-6, atol=0)  # type: ignore[arg-type]
        for a, b in zip(norms, expected, strict=True)
    )
    return _same(model, reference, rtol) and close_norms


@pytest.fixture(scope="module")
def world2() -> Any:
    with World(2) as world:
        yield world


DDP_CASES = [  # accumulation_steps, clip_grad_norm, clip_mode, gradient_as_bucket_view
    (1, None, "previous", False),
    (2, None, "previous", False),
    (2, None, "previous", True),
    (2, CLIP, "two_pass", False),
    (1, CLIP, "previous", True),
]
FSDP_CASES = [  # accumulation_steps, clip_grad_norm, clip_mode, optimizer
    (1, None, "previous", "torch.optim.Adam"),
    (1, None, "previous", "fo.adamw (transform)"),
    (2, None, "previous", "fo.sgd (callable)"),
    (1, CLIP, "two_pass", "torch.optim.Adam"),
    (2, CLIP, "previous", "fo.adamw (transform)"),
]


@pytest.mark.distributed
def test_ddp_matches_step_after_backward(world2: World) -> None:
    for case in DDP_CASES:
        assert world2.run(_ddp_check, *case) == [True, True], case


@pytest.mark.distributed
def test_ddp_refusals_remove_and_ignored_params(world2: World) -> None:
    assert world2.run(_ddp_extras_check) == [[], []]


@pytest.mark.distributed
def test_fsdp2_matches_step_after_backward(world2: World) -> None:
    for case in FSDP_CASES:
        assert world2.run(_fsdp_check, *case) == [True, True], case
