"""Benchmark: ``fo.pure_step`` of the element-wise aliases against torch's nearest in-place step.

10M float32 params (1M with ``--quick``) in 10, 100 and 1000 equal tensors (every fourth one
1-D), and in a skewed model (1000 tensors, one holding 60% of the params: the shapes of
``benchmarks/chain_throughput.py``). Each row times
``params, state = fo.pure_step(fo.<alias>(...))(params, grads, state)`` (new params and state
every step, nothing the caller passed is written to) against torch's nearest in-place step on
the same params, in alternating rounds (one step each, rotating order) in the same process; the
table gives medians and the ratio ours / torch:

* Adam, AdamW, SGD with momentum: ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` with
  ``fused=True``;
* RMSprop: ``torch.optim.RMSprop(foreach=True)`` (torch has no fused RMSprop);
* Lion: torch.optim has none; the reference is Lion with decoupled weight decay in torch
  ``_foreach`` ops (``benchmarks/chain_throughput.py``'s).

Before timing, each row checks that one pure step leaves its inputs alone and equals
``tx.step`` on copies, bitwise.

Usage: ``python benchmarks/pure_step_speed.py [--quick] [--threads N] [--repeats N]
[--only adam,lion]``; ``main(argv) -> str`` returns the markdown table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

import functional_optim as fo
from _harness import benchmark_parser, interleaved_median_ms, table
from chain_throughput import LION_B1, LION_B2, LR, WD, _leaves, _make, _torch_lion

MOMENTUM = 0.9
#: (tensors, skewed): few large tensors, the two uniform models, and the skewed one
MODELS = ((10, False), (100, False), (1000, False), (1000, True))
HEADERS = ("algorithm", "tensors", "ours", "ours ms", "torch reference", "torch ms", "x torch")
Step = Callable[[], Any]


def _torch_optim(make: Callable[[list[Tensor]], torch.optim.Optimizer]) -> Any:
    def build(params: list[Tensor], grads: list[Tensor]) -> Step:
        return make(_leaves(params, grads)).step

    return build


#: name -> (our transform, torch's reference label, build torch's step)
ALGORITHMS: dict[str, tuple[Callable[[], fo.GradientTransformation], str, Any]] = {
    "adam": (
        lambda: fo.adam(lr=LR),
        "Adam(fused)",
        _torch_optim(lambda p: torch.optim.Adam(p, lr=LR, fused=True)),
    ),
    "adamw": (
        lambda: fo.adamw(lr=LR, weight_decay=WD),
        "AdamW(fused)",
        _torch_optim(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD, fused=True)),
    ),
    "sgd-momentum": (
        lambda: fo.sgd(lr=LR, momentum=MOMENTUM),
        "SGD(momentum, fused)",
        _torch_optim(lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM, fused=True)),
    ),
    "lion": (
        lambda: fo.lion(LR, LION_B1, LION_B2, weight_decay=WD),
        "foreach Lion",
        _torch_lion,
    ),
    "rmsprop": (
        lambda: fo.rmsprop(lr=LR),
        "RMSprop(foreach)",
        _torch_optim(lambda p: torch.optim.RMSprop(p, lr=LR, foreach=True)),
    ),
}


def _state_tensors(state: Any) -> list[Tensor]:
    return [
        x
        for x in optree.tree_leaves(state, none_is_leaf=True, namespace="functional_optim")
        if isinstance(x, Tensor)
    ]


def _check(tx: fo.GradientTransformation, params: list[Tensor], grads: list[Tensor]) -> None:
    """One pure step equals ``tx.step`` on copies, bitwise, and writes no input."""
    assert tx.step is not None
    state = tx.step([p.clone() for p in params], [g.clone() for g in grads], tx.init(params))
    before = [t.clone() for t in [*params, *grads, *_state_tensors(state)]]
    new_params, new_state = fo.pure_step(tx)(params, grads, state)
    after = [*params, *grads, *_state_tensors(state)]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "input written"
    ref_params = [p.clone() for p in params]
    ref_state = tx.step(ref_params, [g.clone() for g in grads], state)
    ours = [*new_params, *_state_tensors(new_state)]
    ref = [*ref_params, *_state_tensors(ref_state)]
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True)), "not tx.step's"


def _ours(tx: fo.GradientTransformation, params: list[Tensor], grads: list[Tensor]) -> Step:
    step = fo.pure_step(tx)
    box: list[Any] = [[p.clone() for p in params], None]
    box[1] = tx.init(box[0])

    def run() -> None:
        box[0], box[1] = step(box[0], grads, box[1])

    return run


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark and return its markdown table."""
    parser = benchmark_parser(__doc__, "1M params, few repeats")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated algorithm names")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    total = 1_000_000 if args.quick else 10_000_000
    repeats = args.repeats or (5 if args.quick else 11)
    names = list(ALGORITHMS) if args.only is None else args.only.split(",")
    rows: list[list[object]] = []
    for n, skewed in MODELS:
        params, grads = _make(total, n, skewed)
        for name in names:
            make_tx, label, build_torch = ALGORITHMS[name]
            _check(make_tx(), params[:8], grads[:8])
            steps = {"ours": _ours(make_tx(), params, grads), "torch": build_torch(params, grads)}
            with torch.no_grad():
                ms = interleaved_median_ms(steps, args.warmup, repeats)
            del steps
            rows.append(
                [
                    name,
                    f"{n} skewed" if skewed else n,
                    f"fo.pure_step(fo.{name.split('-')[0]})",
                    f"{ms['ours']:.2f}",
                    label,
                    f"{ms['torch']:.2f}",
                    f"{ms['ours'] / ms['torch']:.2f}",
                ]
            )
    lines = [
        f"### fo.pure_step vs torch's in-place step: {total / 1e6:g}M float32 params, "
        f"{args.threads} thread(s), median of {repeats} alternating rounds",
        "",
        *table(HEADERS, rows, "lrlrlrr"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
