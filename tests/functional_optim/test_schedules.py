"""Schedules: closed-form values, tensor and int counts agree, argument checks."""

from __future__ import annotations

import math

import pytest
import torch

import functional_optim as fo


def value(schedule: fo.Schedule, t: int) -> float:
    by_int = float(schedule(t))
    by_tensor = float(schedule(torch.tensor(t)))
    assert by_int == by_tensor
    return by_int


def test_constant() -> None:
    s = fo.constant_schedule(0.25)
    assert [value(s, t) for t in (0, 5, 100)] == [0.25, 0.25, 0.25]


def test_linear() -> None:
    s = fo.linear_schedule(1.0, 0.0, transition_steps=4, transition_begin=2)
    assert [value(s, t) for t in range(8)] == pytest.approx([1, 1, 1, 0.75, 0.5, 0.25, 0, 0])
    assert value(fo.linear_schedule(3.0, 1.0, 0), 10) == 3.0
    with pytest.raises(ValueError, match="transition_begin"):
        fo.linear_schedule(1.0, 0.0, 3, transition_begin=-1)


def test_cosine_decay_matches_formula_and_torch_cosine_annealing() -> None:
    s = fo.cosine_decay_schedule(0.1, 10, alpha=0.1)
    for t in range(13):
        c = min(t, 10)
        expected = 0.1 * (0.9 * 0.5 * (1 + math.cos(math.pi * c / 10)) + 0.1)
        assert value(s, t) == pytest.approx(expected, rel=1e-14)
    # torch's CosineAnnealingLR follows the same curve with eta_min = alpha * init
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=0.01)
    for t in range(10):
        assert opt.param_groups[0]["lr"] == pytest.approx(value(s, t), rel=1e-12)
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match="decay_steps"):
        fo.cosine_decay_schedule(0.1, 0)


def test_warmup_cosine_decay() -> None:
    s = fo.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=12, end_value=0.1)
    assert [value(s, t) for t in range(5)] == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert value(s, 8) == pytest.approx(0.1 + 0.9 * 0.5)
    assert value(s, 12) == pytest.approx(0.1)
    assert value(s, 50) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="warmup_steps"):
        fo.warmup_cosine_decay_schedule(0.0, 1.0, 5, 5)
