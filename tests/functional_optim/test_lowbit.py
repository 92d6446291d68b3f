"""Low-bit optimizer states (``fo.quantized_state`` and the 8-bit / 4-bit / fp8 aliases)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import functional_optim as fo
from functional_optim._lowbit import fused_cpu
from functional_optim._lowbit import transform as lowbit_transform
from functional_optim._lowbit.codes import code_map
from functional_optim._lowbit.convert import max_error
from functional_optim.lowbit import dequantized_state_dict, quantized_state_dict

ALIASES = {
    "adamw8bit": fo.adamw8bit,
    "adam8bit": fo.adam8bit,
    "adamw4bit": fo.adamw4bit,
    "adamw_fp8": fo.adamw_fp8,
}
SHAPES = [(40, 70), (5,), (3000,), (33, 129)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize(
    ("kind", "signed"), [(k, s) for k in ("int8", "int4") for s in (True, False)]
)
def test_encoding_is_the_nearest_code(kind: str, signed: bool) -> None:
    cmap = code_map(kind, signed)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(50_000, generator=gen) * (2 if signed else 1) - (1 if signed else 0)
    x[:4] = torch.tensor([1.0, 0.0, 1e-30, 2e-9])
    got = cmap.decode(cmap.encode(x))
    candidates = cmap.table.clone()
    if not signed:  # a second moment never rounds a non-zero value to zero
        candidates[candidates == 0] = float("inf")
    nearest = cmap.table[(x[:, None] - candidates[None, :]).abs().argmin(1)]
    nearest[x == 0] = 0.0
    if kind == "int4":  # ties go to the smaller code
        assert torch.equal(got, nearest)
    else:  # the minifloat breaks ties to the even fraction
        assert torch.equal((got - x).abs(), (nearest - x).abs())
        assert bool(torch.isin(got, cmap.table).all())
    assert got[0] == 1.0
    assert got[1] == 0.0
    assert signed or bool((got[x > 0] > 0).all())
    assert cmap.zero == 0
    assert float(cmap.table[cmap.zero]) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 3}, "power of two"),
        ({"block_size": 0}, "power of two"),
        ({"block_size": True}, "power of two"),
        ({"block_size": 64.0}, "power of two"),
        ({"min_size": -1}, "min_size"),
        ({"lr": -1.0}, "Invalid learning rate"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fo.adamw8bit(**kwargs)


def test_bad_kind_and_non_float_params_raise() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        fo.quantized_state(fo.adamw(), kind="int2")
    with pytest.raises(ValueError, match="floating-point"):
        fo.Optimizer([torch.zeros(10, dtype=torch.int64)], fo.adamw8bit())
    with pytest.raises(ValueError, match="start at zero"):
        fo.quantized_state(fo.adagrad(initial_accumulator_value=0.1))


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_small_params_keep_fp32_state_bitwise_like_the_fp32_alias(name: str) -> None:
    params, ref = _params(), _params()
    fp32 = fo.adam(lr=1e-2) if name == "adam8bit" else fo.adamw(lr=1e-2)
    opt = fo.Optimizer(params, ALIASES[name](lr=1e-2, min_size=100_000))
    _train(opt, params, range(3))
    _train(fo.Optimizer(ref, fp32), ref, range(3))
    assert all(torch.equal(a, b) for a, b in zip(params, ref, strict=True))


@pytest.mark.parametrize(
    ("name", "tol"), [("adamw8bit", 2e-3), ("adamw_fp8", 4e-3), ("adamw4bit", 2e-2)]
)
def test_close_to_torch_adamw(name: str, tol: float) -> None:
    params, ref = _params(), _params()
    _train(fo.Optimizer(params, ALIASES[name](lr=1e-3, min_size=64)), params, range(10))
    _train(torch.optim.AdamW(ref, lr=1e-3), ref, range(10))
    # 10 steps of lr 1e-3 move each element by up to 1e-2; the low-bit error is a fraction
    for p, r in zip(params, ref, strict=True):
        assert float((p - r).detach().abs().max()) <= tol
    assert any(not torch.equal(p, r) for p, r in zip(params, ref, strict=True))


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_batch_size_does_not_change_the_numbers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = []
    for batch in (64, 1 << 18):
        monkeypatch.setattr(lowbit_transform, "BATCH_ELEMENTS", batch)
        params = _params()
        _train(
            fo.Optimizer(params, ALIASES[name](lr=1e-2, min_size=64, block_size=32)),
            params,
            range(4),
        )
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_state_dict_keys_dtypes_and_bytes() -> None:
    params = _params()
    opt = fo.Optimizer(params, fo.adamw8bit(lr=1e-3, min_size=1000, block_size=64))
    _train(opt, params, range(1))
    state = opt.state_dict()["state"]
    assert set(state[1]) == {"step", "exp_avg", "exp_avg_sq"}  # 5 elements: fp32
    for i in (0, 2, 3):
        n = params[i].numel()
        blocks = -(-n // 64)
        assert set(state[i]) == {
            "step",
            "exp_avg_codes",
            "exp_avg_scales",
            "exp_avg_sq_codes",
            "exp_avg_sq_scales",
        }
        assert state[i]["exp_avg_codes"].dtype == torch.uint8
        assert state[i]["exp_avg_codes"].shape == (blocks * 64,)
        assert state[i]["exp_avg_sq_scales"].dtype == torch.float32
        assert state[i]["exp_avg_sq_scales"].shape == (blocks,)
    group = opt.state_dict()["param_groups"][0]
    assert (group["kind"], group["block_size"], group["min_size"]) == ("int8", 64, 1000)


@pytest.mark.parametrize(
    ("name", "limit"), [("adamw8bit", 2.1), ("adamw_fp8", 2.1), ("adamw4bit", 1.1)]
)
def test_state_bytes_per_param(name: str, limit: float) -> None:
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(4)]
    opt = fo.Optimizer(params, ALIASES[name](lr=1e-3))
    _train(opt, params, range(1))
    total = sum(
        v.numel() * v.element_size()
        for s in opt.state_dict()["state"].values()
        for k, v in s.items()
        if k != "step"
    )
    assert total / sum(p.numel() for p in params) <= limit


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_state_dict_round_trip_resumes_bitwise(name: str) -> None:
    make = lambda p: fo.Optimizer(p, ALIASES[name](lr=1e-2, min_size=64, block_size=64))  # noqa: E731
    params = _params()
    opt = make(params)
    _train(opt, params, range(5))
    params_b = [torch.nn.Parameter(p.detach().clone()) for p in _params()]
    opt_b = make(params_b)
    params_a = _params()
    opt_a = make(params_a)
    _train(opt_a, params_a, range(3))
    saved = pickle.loads(pickle.dumps(opt_a.state_dict()))
    with torch.no_grad():
        for pb, pa in zip(params_b, params_a, strict=True):
            pb.copy_(pa)
    opt_b.load_state_dict(saved)
    _train(opt_b, params_b, range(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(params, params_b, strict=True))
    clone = copy.deepcopy(opt)
    assert clone.state_dict()["state"][0]["exp_avg_codes"].equal(
        opt.state_dict()["state"][0]["exp_avg_codes"]
    )
    pickle.loads(pickle.dumps(opt))


def test_fp32_round_trip_with_stated_error() -> None:
    params = _params()
    opt = fo.Optimizer(params, fo.adamw8bit(lr=1e-2, min_size=64, block_size=64))
    _train(opt, params, range(3))
    low = opt.state_dict()
    fp32 = dequantized_state_dict(low, params)
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    torch_opt.load_state_dict(fp32)  # loads into torch's fp32 optimizer
    back = quantized_state_dict(torch_opt.state_dict(), "int8", 64, 64)
    for i, entry in low["state"].items():
        for key, value in entry.items():
            assert torch.equal(back["state"][i][key], value), (i, key)  # exact: codes re-encode
    # quantising an arbitrary fp32 state: error within the stated bound
    ref = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    _train(ref, ref.param_groups[0]["params"], range(2))
    sd = ref.state_dict()
    again = dequantized_state_dict(quantized_state_dict(sd, "int8", 64, 64), params)
    for i, entry in sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            exact, approx = entry[key].reshape(-1), again["state"][i][key].reshape(-1)
            pad = -exact.numel() % 64
            scale = torch.nn.functional.pad(exact.abs(), (0, pad)).view(-1, 64).amax(1)
            bound = max_error("int8", key) * scale.repeat_interleave(64)[: exact.numel()]
            assert bool(((exact - approx).abs() <= bound * (1 + 1e-6) + 1e-30).all())
    fo.Optimizer(params, fo.adamw8bit(lr=1e-2, min_size=64, block_size=64)).load_state_dict(back)


def test_layout_mismatch_and_bad_grads_raise_before_any_change() -> None:
    params = _params()
    opt = fo.Optimizer(params, fo.adamw8bit(lr=1e-2, min_size=64, block_size=64))
    _train(opt, params, range(2))
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.transform_states[0])
    grads = [torch.ones(3)] + [torch.ones_like(p) for p in params[1:]]
    with pytest.raises(ValueError, match="gradient of param 0"):
        opt.transform.step([p.detach() for p in params], grads, state)
    assert all(torch.equal(a, b) for a, b in zip(params, before, strict=True))
    other = fo.Optimizer(params, fo.adamw8bit(lr=1e-2, min_size=64, block_size=128))
    with pytest.raises(RuntimeError, match="must match the size"):
        other.load_state_dict(opt.state_dict())  # saved with 64-element blocks
    tx64, tx128 = (fo.quantized_state(fo.adamw(lr=1e-2), "int8", b, 64) for b in (64, 128))
    plain = [p.detach().clone() for p in params]
    ones = [torch.ones_like(p) for p in params]
    stepped = tx64.step(plain, ones, tx64.init(plain))
    with pytest.raises(ValueError, match="laid out for another"):
        tx128.step(plain, ones, stepped)


def test_lr_scheduler_and_lion8bit() -> None:
    params = _params()
    opt = fo.Optimizer(params, fo.lion8bit(lr=1e-3, min_size=64))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.0)
    _train(opt, params, range(1))
    sched.step()
    frozen = [p.detach().clone() for p in params]
    _train(opt, params, range(1, 2))  # lr 0: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(params, frozen, strict=True))
    assert "mu_codes" in opt.state_dict()["state"][0]  # Lion's momentum (optax's name)


def _least_squares(make, seed: int, steps: int = 300) -> float:
    """benchmarks/lowbit_states.py's problem: 4 x (256x256), ``mean((X W - Y)^2)``, X and Y
    standard normal, W from zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=gen)
    ys = [torch.randn(256, 256, generator=gen) for _ in range(4)]
    ws = [torch.nn.Parameter(torch.zeros(256, 256)) for _ in ys]
    opt = make(ws)
    scale = 2.0 / (256 * 256 * 4)
    for _ in range(steps):
        with torch.no_grad():
            for w, y in zip(ws, ys, strict=True):
                w.grad = (x.T @ (x @ w - y)).mul_(scale)
        opt.step()
    with torch.no_grad():
        return sum(float((x @ w - y).square().mean()) for w, y in zip(ws, ys, strict=True)) / 4


@pytest.mark.parametrize(
    ("name", "limit"), [("adamw8bit", 0.015), ("adamw_fp8", 0.015), ("adamw4bit", 0.10)]
)
def test_least_squares_targets(name: str, limit: float) -> None:
    """8-bit and fp8 within 1.5% of fp32 AdamW's final loss, 4-bit within 10% (torchao's
    AdamW4bit: +28.5% on this problem, benchmarks/lowbit_states.py)."""
    base = _least_squares(lambda p: torch.optim.AdamW(p, lr=1e-2), 0)
    alias = ALIASES[name]
    loss = _least_squares(lambda p: fo.Optimizer(p, alias(lr=1e-2)), 0)
    assert abs(loss / base - 1) <= limit, (loss, base)


@pytest.mark.parametrize("kind", ["int4"])
def test_compiled_codec_gives_the_same_bits(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one inductor smoke test: torch.compile'd blockwise codec == eager, bit for bit."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(lowbit_transform, "BATCH_ELEMENTS", 256)  # full compiled runs of 1024
    monkeypatch.setattr(fused_cpu, "extension", lambda: None)  # the batched path, not the C++ one
    runs = []
    graphs = counters["stats"]["unique_graphs"]
    for compiled in (False, True):
        params = _params()
        tx = fo.quantized_state(fo.adamw(lr=1e-2), kind, 64, 64, compile=compiled)
        _train(fo.Optimizer(params, tx), params, range(3))
        runs.append(params)
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled codec ran
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_dcp_round_trip_in_one_process(tmp_path: pytest.TempPathFactory) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 8))
        return model, fo.Optimizer(model.parameters(), fo.adamw8bit(lr=1e-2, min_size=1000))

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            model(torch.randn(4, 128, generator=gen)).sum().backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    train(model, opt, range(2))
    state = get_optimizer_state_dict(model, opt)
    assert set(state["state"]["0.weight"]) >= {"exp_avg_codes", "exp_avg_sq_scales"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": state}, checkpoint_id=str(tmp_path))
        model2, opt2 = make()
        model2.load_state_dict(model.state_dict())
        target = get_optimizer_state_dict(model2, opt2)
        dcp.load({"optim": target}, checkpoint_id=str(tmp_path))
    set_optimizer_state_dict(model2, opt2, target)
    train(model, opt, range(2, 4))
    train(model2, opt2, range(2, 4))
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
