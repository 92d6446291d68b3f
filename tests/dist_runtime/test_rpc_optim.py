"""dist_runtime.rpc_optim and _param_locks: locks, failure collection, scripted numerics, RPC.

The RPC checks run in one 2-rank TensorPipe world: rank 0 is the trainer, rank 1 owns the
parameters. Worker-side helpers are module-level so that the ranks can import them.
"""

import gc
import threading
import time
import warnings
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, optim
from torch.distributed import rpc

import functional_optim as fo
from dist_runtime import rpc_optim
from dist_runtime._param_locks import ParamLockRegistry, param_keys
from dist_runtime._script_local_optimizer import ScriptLocalOptimizerModule
from tests._world import World

# -- lock registry (no RPC) -----------------------------------------------------------------------


def test_same_params_share_one_lock_and_disjoint_params_do_not() -> None:
    registry = ParamLockRegistry()
    a, b = torch.zeros(3), torch.zeros(3)
    first, again, other = registry.register([a]), registry.register([a]), registry.register([b])
    assert first.ranks == again.ranks
    assert len(first.ranks) == 1
    assert set(first.ranks).isdisjoint(other.ranks)


def test_overlapping_sets_take_every_lock_in_rank_order() -> None:
    registry = ParamLockRegistry()
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    only_a, only_b = registry.register([a]), registry.register([b])
    both = registry.register([b, a, c])
    assert both.ranks == tuple(sorted(only_a.ranks + only_b.ranks))
    # c joined the lowest lock of the set, so a later set on c alone serialises with only_a.
    assert registry.register([c]).ranks == (min(both.ranks),)


def test_views_of_one_storage_share_a_lock() -> None:
    registry = ParamLockRegistry()
    base = torch.zeros(10)
    assert registry.register([base[:5]]).ranks == registry.register([base[5:]]).ranks


def test_close_forgets_keys_once_no_set_holds_them() -> None:
    registry = ParamLockRegistry()
    a = torch.zeros(2)
    one, two = registry.register([a]), registry.register([a])
    assert len(registry) == 2  # tensor key + storage key
    one.close()
    one.close()  # idempotent
    assert len(registry) == 2
    two.close()
    assert len(registry) == 0


def test_lock_sets_exclude_overlapping_and_admit_disjoint_holders() -> None:
    registry = ParamLockRegistry()
    a, b = torch.zeros(2), torch.zeros(2)
    set_a, set_b, set_ab = registry.register([a]), registry.register([b]), registry.register([a, b])
    entered = {"b": threading.Event(), "ab": threading.Event()}

    def hold(lock_set: Any, name: str) -> None:
        with lock_set:
            entered[name].set()

    with set_a:
        t_ab = threading.Thread(target=hold, args=(set_ab, "ab"))
        t_b = threading.Thread(target=hold, args=(set_b, "b"))
        t_ab.start()
        t_b.start()
        assert entered["b"].wait(10), "a disjoint set was blocked"
        assert not entered["ab"].wait(0.2), "an overlapping set entered while a was held"
    assert entered["ab"].wait(10)
    t_ab.join(10)
    t_b.join(10)


# -- wait_all (no RPC) ----------------------------------------------------------------------------


def _done(value: Any = None, exc: BaseException | None = None) -> torch.futures.Future[Any]:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    if exc is None:
        fut.set_result(value)
    else:
        fut.set_exception(exc)
    return fut


def test_wait_all_returns_values_in_order() -> None:
    assert rpc_optim.wait_all([_done(1), _done(2)], ["w1", "w2"]) == [1, 2]


def test_wait_all_reraises_a_single_remote_failure_unchanged() -> None:
    error = ValueError("On WorkerInfo(id=1, name=worker1):\nValueError('boom')")
    with pytest.raises(ValueError, match="boom") as info:
        rpc_optim.wait_all([_done(1), _done(exc=error)], ["w0", "w1"])
    assert info.value is error


def test_wait_all_reports_every_failure_after_every_future_settled() -> None:
    late: torch.futures.Future[Any] = torch.futures.Future()
    timer = threading.Timer(0.2, late.set_exception, args=(ValueError("On WorkerInfo(2): late"),))
    timer.start()
    futures = [_done(exc=ValueError("On WorkerInfo(1): early")), _done(0), late]
    with pytest.raises(ValueError, match=r"(?s)2 of 3 workers failed.*early.*late"):
        rpc_optim.wait_all(futures, ["worker1", "worker0", "worker2"])
    assert late.done()
    timer.join()


def test_wait_all_mixed_failure_types_raise_runtime_error_listing_all() -> None:
    futures = [
        _done(exc=ValueError("On WorkerInfo(1): v")),
        _done(exc=KeyError("On WorkerInfo(2): k")),
    ]
    with pytest.raises(RuntimeError, match=r"(?s)worker1: ValueError.*worker2: KeyError"):
        rpc_optim.wait_all(futures, ["worker1", "worker2"])


def test_wait_all_names_the_worker_of_a_transport_failure() -> None:
    futures = [_done(exc=RuntimeError("eof (this error originated at tensorpipe)"))]
    with pytest.raises(RuntimeError, match=r"RPC to worker3 for the step failed: eof .*shut down"):
        rpc_optim.wait_all(futures, ["worker3"], "the step")


# -- scripted local optimizer numerics (no RPC) ---------------------------------------------------

# The eight functional optimizers, with non-default hyperparameters where they exercise more code.
EIGHT: list[tuple[type, type, dict[str, Any]]] = [
    (optim.SGD, fo.FunctionalSGD, {"lr": 0.05}),
    (optim.SGD, fo.FunctionalSGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    (optim.Adam, fo.FunctionalAdam, {"lr": 0.01, "amsgrad": True}),
    (optim.AdamW, fo.FunctionalAdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (optim.Adamax, fo.FunctionalAdamax, {"lr": 0.05}),
    (optim.Adagrad, fo.FunctionalAdagrad, {"lr": 0.05}),
    (optim.Adadelta, fo.FunctionalAdadelta, {"rho": 0.95}),
    (optim.RMSprop, fo.FunctionalRMSprop, {"lr": 0.05, "momentum": 0.5}),
    (optim.Rprop, fo.FunctionalRprop, {"lr": 0.05}),
]
# The functional optimizers pick the fastest CPU kernel (fused / foreach) where torch.optim's
# default is the per-tensor loop, so they may differ from it by a few float32 ulps per step
# (tests/functional_optim checks their bitwise paths). Scripted vs eager must be bitwise equal.
VS_TORCH = {"rtol": 1e-5, "atol": 1e-6}


def _ids(case: tuple[type, type, dict[str, Any]]) -> str:
    return case[0].__name__ + "".join(f"-{k}" for k in case[2] if k != "lr")


@pytest.mark.parametrize("case", EIGHT, ids=_ids)
def test_scripted_module_matches_eager_functional_and_torch(
    case: tuple[type, type, dict[str, Any]],
) -> None:
    torch_cls, functional_cls, kwargs = case
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(6, 5, generator=gen), torch.randn(5, generator=gen)] for _ in range(3)]
    grads[1][1] = None  # type: ignore[call-overload]  # a parameter without gradient is skipped

    scripted_params = [p.clone() for p in start]
    module = rpc_optim.script_quietly(
        ScriptLocalOptimizerModule(functional_cls, scripted_params, (), kwargs)
    )
    eager_params = [p.clone() for p in start]
    eager = functional_cls(eager_params, **kwargs)
    torch_params = [p.clone().requires_grad_() for p in start]
    reference = torch_cls(torch_params, **kwargs)
    for row in grads:
        module.step_with_gradients(row)
        eager.step(row)
        for param, grad in zip(torch_params, row, strict=True):
            param.grad = None if grad is None else grad.clone()
        reference.step()

    for ours, theirs in zip(scripted_params, eager_params, strict=True):
        assert torch.equal(ours, theirs), "scripting changed the functional optimizer's result"
    assert not torch.equal(scripted_params[0], start[0]), "the scripted step did not update"
    for ours, theirs in zip(scripted_params, torch_params, strict=True):
        torch.testing.assert_close(ours, theirs.detach(), **VS_TORCH)


def test_scripting_emits_no_deprecation_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = ScriptLocalOptimizerModule(fo.FunctionalSGD, [torch.zeros(2)], (0.1,), {})
        rpc_optim.script_quietly(module)


def test_compile_class_reports_torchscript_reason() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)_Unscriptable cannot be compiled.*Dict"):
        rpc_optim.compile_class(_Unscriptable)


class _Unscriptable:
    def __init__(self, params: List[Tensor], lr: float = 0.1) -> None:
        self.table = {1: "a", "b": 2}  # heterogeneous dict: not scriptable

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        pass


# -- RPC world ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2() -> Any:
    with World(2, init_pg=False, init_rpc=True) as world:
        yield world


# Worker-side (owner) helpers.
_BARRIER: list[threading.Barrier] = []


def _zeros(numel: int) -> Tensor:
    return torch.zeros(numel, requires_grad=True)


def _sum(param: rpc.RRef[Tensor]) -> Tensor:
    return param.local_value().sum()


def _arm_barrier(parties: int) -> dict[str, int]:
    _BARRIER[:] = [threading.Barrier(parties, timeout=20)]
    return rpc_optim.step_stats(reset=True)


def _stats() -> dict[str, int]:
    return rpc_optim.step_stats()


def _owner_state(handle: int, param: rpc.RRef[Tensor]) -> tuple[bool, bool]:
    """Whether local optimizer ``handle`` lives, and whether ``param`` has registered locks."""
    keys = param_keys(param.local_value())
    registered = all(key in rpc_optim.param_locks._entries for key in keys)
    return handle in rpc_optim._local_optimizers, registered


def _lock_ranks(local: rpc.RRef[Any]) -> tuple[int, ...]:
    return local.local_value().lock_ranks  # type: ignore[no-any-return]


@torch.jit.ignore  # type: ignore[misc]
def _barrier_wait() -> None:
    """Block until every armed step on this worker is inside its update (proves overlap)."""
    _BARRIER[0].wait()


class BarrierSGD(optim.Optimizer):
    """SGD whose step waits at a worker-wide barrier: steps that cannot overlap time out."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        _barrier_wait()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


class FunctionalBarrierSGD:
    """Scripted twin of :class:`BarrierSGD` (the barrier is a Python call out of TorchScript)."""

    def __init__(
        self, params: List[Tensor], lr: float = 0.1, _allow_empty_param_list: bool = False
    ) -> None:
        self.defaults: Dict[str, float] = {"lr": lr}
        self.param_group: Dict[str, List[Tensor]] = {"params": params}
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        _barrier_wait()
        params = self.param_group["params"]
        with torch.no_grad():
            for i in range(len(params)):
                grad = gradients[i]
                if grad is not None:
                    params[i].add_(grad, alpha=-self.defaults["lr"])


# Trainer-side (rank 0) helpers.


def _build(cls: type, rrefs: list[Any], scripted: bool, **kwargs: Any) -> Any:
    from compat_api.optimizer import DistributedOptimizer

    if scripted:
        opt = DistributedOptimizer(cls, rrefs, **kwargs)
    else:
        torch.jit._state.disable()
        try:
            opt = DistributedOptimizer(cls, rrefs, **kwargs)
        finally:
            torch.jit._state.enable()
    assert opt.is_functional_optim == scripted
    return opt


def _train_steps(opt: Any, param: Any, steps: int) -> None:
    for _ in range(steps):
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync("worker1", _sum, args=(param,))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)


def _run_threads(targets: list[tuple[Any, tuple[Any, ...]]]) -> None:
    errors: list[BaseException] = []

    def run(fn: Any, args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a trainer thread hung"
    if errors:
        raise errors[0]


def _concurrent_same_params(
    rank: int, world_size: int, scripted: bool, kwargs: dict[str, Any]
) -> tuple[float, float]:
    """4 trainers x 25 steps of SGD(lr=1) on one param whose gradient is all ones."""
    param = rpc.remote("worker1", _zeros, args=(1_000_000,))
    trainers = [_build(optim.SGD, [param], scripted, **kwargs) for _ in range(4)]
    _run_threads([(_train_steps, (opt, param, 25)) for opt in trainers])
    value = param.to_here().detach()
    return float(value.min()), float(value.max())


def _overlap_disjoint(rank: int, world_size: int, scripted: bool) -> dict[str, int]:
    from compat_api.utils import register_functional_optim

    register_functional_optim(BarrierSGD, FunctionalBarrierSGD)
    params = [rpc.remote("worker1", _zeros, args=(10,)) for _ in range(2)]
    trainers = [_build(BarrierSGD, [p], scripted, lr=1.0) for p in params]
    rpc.rpc_sync("worker1", _arm_barrier, args=(2,))
    _run_threads([(_train_steps, (opt, p, 1)) for opt, p in zip(trainers, params, strict=True)])
    for p in params:
        assert torch.equal(p.to_here(), -torch.ones(10))
    return rpc.rpc_sync("worker1", _stats)  # type: ignore[no-any-return]


def _lock_sharing(rank: int, world_size: int) -> dict[str, Any]:
    a, b = (rpc.remote("worker1", _zeros, args=(4,)) for _ in range(2))
    opt_a1 = _build(optim.SGD, [a], True, lr=0.1)
    opt_a2 = _build(optim.SGD, [a], False, lr=0.1)
    opt_b = _build(optim.SGD, [b], True, lr=0.1)
    opt_ab = _build(optim.SGD, [a, b], False, lr=0.1)

    def ranks(opt: Any) -> tuple[int, ...]:
        rref = opt.remote_optimizers[0]
        return rpc.rpc_sync("worker1", _lock_ranks, args=(rref,))  # type: ignore[no-any-return]

    return {"a1": ranks(opt_a1), "a2": ranks(opt_a2), "b": ranks(opt_b), "ab": ranks(opt_ab)}


def _lifetime(rank: int, world_size: int) -> dict[str, Any]:
    param = rpc.remote("worker1", _zeros, args=(4,))
    opt = _build(optim.SGD, [param], True, lr=0.1)
    handle = opt._remotes[0].handle
    during = rpc.rpc_sync("worker1", _owner_state, args=(handle, param))
    del opt
    gc.collect()
    deadline = time.monotonic() + 20
    after = rpc.rpc_sync("worker1", _owner_state, args=(handle, param))
    while after != (False, False) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = rpc.rpc_sync("worker1", _owner_state, args=(handle, param))
    try:
        with dist_autograd.context() as context_id:
            rpc.rpc_sync("worker1", rpc_optim.step_local_optimizer, args=(handle, context_id))
        stale = "no error"
    except RuntimeError as exc:
        stale = str(exc)
    return {"during": during, "after": after, "stale": stale}


@pytest.mark.distributed
@pytest.mark.parametrize("scripted", [True, False], ids=["scripted", "python"])
@pytest.mark.parametrize("kwargs", [{"lr": 1.0}, {"lr": 1.0, "foreach": True}], ids=str)
def test_concurrent_trainers_lose_no_update(
    world2: World, scripted: bool, kwargs: dict[str, Any]
) -> None:
    # torch's TorchScript path takes no lock: elements end 1-5 steps short of -100.
    low, high = world2.run_on([0], _concurrent_same_params, scripted, kwargs)[0]
    assert (low, high) == (-100.0, -100.0)


@pytest.mark.distributed
@pytest.mark.parametrize("scripted", [True, False], ids=["scripted", "python"])
def test_steps_on_disjoint_params_overlap(world2: World, scripted: bool) -> None:
    # Each step waits at a 2-party barrier inside its update: serialised steps would time out.
    stats = world2.run_on([0], _overlap_disjoint, scripted)[0]
    assert stats["max_active"] >= 2
    assert stats["completed"] == 2


@pytest.mark.distributed
def test_optimizers_share_locks_exactly_when_their_params_intersect(world2: World) -> None:
    ranks = world2.run_on([0], _lock_sharing)[0]
    assert ranks["a1"] == ranks["a2"]  # scripted and eager on the same param: one lock
    assert set(ranks["a1"]).isdisjoint(ranks["b"])
    assert ranks["ab"] == tuple(sorted(ranks["a1"] + ranks["b"]))


@pytest.mark.distributed
def test_local_optimizer_and_its_locks_die_with_the_distributed_optimizer(world2: World) -> None:
    state = world2.run_on([0], _lifetime)[0]
    assert state["during"] == (True, True)
    assert state["after"] == (False, False)
    assert "no local optimizer with handle" in state["stale"]
