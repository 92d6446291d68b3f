"""Benchmark: transform chains run in place and the pure path, against torch in the same run.

10M float32 params (1M with ``--quick``) in 100 and in 1000 equal tensors, and in 1000 tensors of
which one matrix holds 60% of the params (``1000 skewed``, an embedding); every fourth tensor
is 1-D (a "bias": no weight decay in the masked rows). Each row pairs one of ours with torch's
nearest equivalent; the pairs are timed in alternating rounds (one step each, rotating order)
and the table gives medians and the ratio ours / torch.

Rows:

* ``adamw chain``: ``fo.Optimizer(chain(clip_by_global_norm, scale_by_adam,
  add_decayed_weights, scale_by_learning_rate))`` vs ``clip_grad_norm_(foreach=True)`` +
  ``AdamW(fused=True)``; ``(tx.step)`` calls the chain's step on lists directly;
* ``lion chain``: ``chain(scale_by_lion, add_decayed_weights, scale_by_learning_rate)`` vs a
  torch reference written here with ``_foreach`` ops (torch.optim has no Lion), in the
  ``lerp`` form torch uses for moments: ``p.mul_(1 - lr*wd)``,
  ``u = lerp(m, g, 1 - b1).sign_()``, ``p.add_(u, alpha=-lr)``, ``m.lerp_(g, 1 - b2)`` (5 ops;
  ours keeps optax's ``(1 - b1) * g + b1 * m`` roundings, 7 ops);
* ``masked decay``: the adamw chain with ``masked(add_decayed_weights, ndim > 1)`` vs clip +
  ``AdamW(fused=True)`` with two param groups (weight decay / none);
* ``multi_transform lr``: clip then ``multi_transform`` of two AdamW chains with different
  learning rates vs clip + ``AdamW(fused=True)`` with two param groups (lr / lr / 10);
* ``rmsprop chain``: ``chain(clip_by_global_norm, scale_by_rms, scale_by_learning_rate)`` vs
  ``clip_grad_norm_(foreach=True)`` + ``RMSprop(foreach=True)`` (torch's RMSprop has no fused
  kernel);
* ``finite adamw``: ``apply_if_finite(adamw chain without clip)`` vs torch's AMP finiteness
  check (``_amp_foreach_non_finite_check_and_unscale_`` at scale 1, what ``GradScaler.unscale_``
  runs) then ``AdamW(fused=True)`` when the gradients are finite;
* ``multisteps adamw``: four calls of ``fo.Optimizer(MultiSteps(adamw chain without clip, 4))``
  (accumulate, step on the mean on the fourth) vs four ``_foreach_add_`` into a sum, its mean
  and ``AdamW(fused=True)`` (a torch user accumulates in ``.grad`` for free and scales the
  loss, so this reference is the cheapest explicit accumulation);
* ``pure adam`` and ``pure adamw chain``: ``tx.update`` + ``apply_updates`` (nothing mutated)
  vs ``Adam(fused=True)``;
* ``pure step adam`` and ``pure step adamw chain``: ``fo.pure_step(tx)`` (the update and
  ``apply_updates`` in one pure call: new params and state, nothing mutated) vs
  ``Adam(fused=True)`` and clip + ``AdamW(fused=True)`` (every element-wise alias:
  ``benchmarks/pure_step_speed.py``);
* ``alias adam``: ``fo.Optimizer(fo.adam())`` and ``FunctionalAdam.step`` vs ``Adam(fused=True)``.

No peer library: optax (JAX) is not installed here.

Usage: ``python benchmarks/chain_throughput.py [--quick] [--threads N] [--repeats N]``;
``main(argv) -> str`` returns the markdown table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import functional_optim as fo
from _harness import benchmark_parser, interleaved_median_ms, table
from functional_optim.functional import FunctionalAdam

LR, WD, MAX_NORM = 1e-4, 1e-2, 1.0
LION_B1, LION_B2 = 0.9, 0.99
ACCUMULATE = 4
HEADERS = ("chain", "tensors", "ours", "ours ms", "torch reference", "torch ms", "x torch")
Step = Callable[[], Any]


#: The models: (tensors, skewed). Skewed: one matrix holds 60% of the params (an embedding),
#: the other tensors share the rest equally.
MODELS = ((100, False), (1000, False), (1000, True))


def _make(total: int, n_tensors: int, skewed: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    gen = torch.Generator().manual_seed(0)
    big = total * 6 // 10 if skewed else 0
    size = (total - big) // (n_tensors - 1 if skewed else n_tensors)
    shapes = [(size,) if i % 4 == 3 else (size // 100, 100) for i in range(n_tensors)]
    if skewed:
        shapes[0] = (big // 100, 100)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-2 for s in shapes]
    return params, grads


def _leaves(params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    leaves = [p.clone().requires_grad_(True) for p in params]
    for leaf, g in zip(leaves, grads, strict=True):
        leaf.grad = g.clone()
    return leaves


def _is_matrix(tree: Any) -> Any:
    return fo.tree_map(lambda p: p is not None and p.ndim > 1, tree)


def _label(tree: Any) -> Any:
    return fo.tree_map(lambda p: "fast" if p is not None and p.ndim > 1 else "slow", tree)


def _adamw_chain(decay: fo.GradientTransformation, lr: float = LR) -> fo.GradientTransformation:
    return fo.chain(fo.scale_by_adam(), decay, fo.scale_by_learning_rate(lr))


def _clip_then(tx: fo.GradientTransformation) -> fo.GradientTransformation:
    return fo.chain(fo.clip_by_global_norm(MAX_NORM), tx)


def _ours_optimizer(tx: fo.GradientTransformation, p: list[Tensor], g: list[Tensor]) -> Step:
    opt = fo.Optimizer(_leaves(p, g), tx)
    return opt.step


def _ours_tx_step(tx: fo.GradientTransformation, p: list[Tensor], g: list[Tensor]) -> Step:
    params = [x.clone() for x in p]
    grads = [x.clone() for x in g]
    state = [tx.init(params)]
    assert tx.step is not None

    def step() -> None:
        assert tx.step is not None
        state[0] = tx.step(params, grads, state[0])

    return step


def _ours_pure(tx: fo.GradientTransformation, p: list[Tensor], g: list[Tensor]) -> Step:
    box: list[Any] = [[x.clone() for x in p], None]
    box[1] = tx.init(box[0])

    def step() -> None:
        updates, box[1] = tx.update(g, box[1], box[0])
        box[0] = fo.apply_updates(box[0], updates)

    return step


def _ours_pure_step(tx: fo.GradientTransformation, p: list[Tensor], g: list[Tensor]) -> Step:
    box: list[Any] = [[x.clone() for x in p], None]
    box[1] = tx.init(box[0])
    step = fo.pure_step(tx)

    def run() -> None:
        box[0], box[1] = step(box[0], g, box[1])

    return run


def _torch_clip_adamw(groups: Callable[[list[Tensor]], Any], clip: bool = True) -> Any:
    def build(p: list[Tensor], g: list[Tensor]) -> Step:
        leaves = _leaves(p, g)
        opt = torch.optim.AdamW(groups(leaves), lr=LR, weight_decay=WD, fused=True)

        def step() -> None:
            if clip:
                torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM, foreach=True)
            opt.step()

        return step

    return build


def _two_groups(key: str, other: Any) -> Callable[[list[Tensor]], Any]:
    def groups(leaves: list[Tensor]) -> Any:
        return [
            {"params": [x for x in leaves if x.ndim > 1]},
            {"params": [x for x in leaves if x.ndim == 1], key: other},
        ]

    return groups


def _torch_finite_adamw(p: list[Tensor], g: list[Tensor]) -> Step:
    leaves = _leaves(p, g)
    opt = torch.optim.AdamW(leaves, lr=LR, weight_decay=WD, fused=True)
    grads = [leaf.grad for leaf in leaves]
    found, one = torch.zeros(1), torch.ones(1)

    def step() -> None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        if float(found) == 0.0:
            opt.step()

    return step


def _ours_multi_steps(p: list[Tensor], g: list[Tensor]) -> Step:
    tx = fo.MultiSteps(_adamw_chain(fo.add_decayed_weights(WD)), ACCUMULATE)
    opt = fo.Optimizer(_leaves(p, g), tx.gradient_transformation())

    def step() -> None:
        for _ in range(ACCUMULATE):
            opt.step()

    return step


def _torch_accumulate_adamw(p: list[Tensor], g: list[Tensor]) -> Step:
    leaves = _leaves(p, g)
    opt = torch.optim.AdamW(leaves, lr=LR, weight_decay=WD, fused=True)
    grads = [leaf.grad for leaf in leaves]
    sums = [torch.zeros_like(x) for x in grads]

    def step() -> None:
        for _ in range(ACCUMULATE):
            torch._foreach_add_(sums, grads)
        torch._foreach_div_(sums, ACCUMULATE)
        for leaf, mean in zip(leaves, sums, strict=True):
            leaf.grad = mean
        opt.step()
        for leaf, grad in zip(leaves, grads, strict=True):
            leaf.grad = grad
        torch._foreach_zero_(sums)

    return step


def _torch_clip_rmsprop(p: list[Tensor], g: list[Tensor]) -> Step:
    leaves = _leaves(p, g)
    opt = torch.optim.RMSprop(leaves, lr=LR, foreach=True)

    def step() -> None:
        torch.nn.utils.clip_grad_norm_(leaves, MAX_NORM, foreach=True)
        opt.step()

    return step


def _torch_lion(p: list[Tensor], g: list[Tensor]) -> Step:
    """Lion with decoupled weight decay in torch ``_foreach`` ops (torch.optim has none)."""
    params = [x.clone() for x in p]
    mu = [torch.zeros_like(x) for x in p]

    def step() -> None:
        torch._foreach_mul_(params, 1.0 - LR * WD)
        update = torch._foreach_lerp(mu, g, 1 - LION_B1)
        torch._foreach_sign_(update)
        torch._foreach_add_(params, update, alpha=-LR)
        torch._foreach_lerp_(mu, g, 1 - LION_B2)

    return step


def _torch_adam(p: list[Tensor], g: list[Tensor]) -> Step:
    return torch.optim.Adam(_leaves(p, g), lr=LR, fused=True).step  # type: ignore[no-any-return]


def _functional_adam(p: list[Tensor], g: list[Tensor]) -> Step:
    opt = FunctionalAdam([x.clone() for x in p], lr=LR)
    grads: list[Tensor | None] = list(g)
    return lambda: opt.step(grads)


def _rows() -> list[tuple[str, str, Any, str, Any]]:
    """``(chain, ours label, build ours, torch label, build torch)``."""
    adamw = _clip_then(_adamw_chain(fo.add_decayed_weights(WD)))
    lion = fo.chain(
        fo.scale_by_lion(LION_B1, LION_B2),
        fo.add_decayed_weights(WD),
        fo.scale_by_learning_rate(LR),
    )
    masked = _clip_then(_adamw_chain(fo.masked(fo.add_decayed_weights(WD), _is_matrix)))
    multi = _clip_then(
        fo.multi_transform(
            {
                "fast": _adamw_chain(fo.add_decayed_weights(WD)),
                "slow": _adamw_chain(fo.add_decayed_weights(WD), LR / 10),
            },
            _label,
        )
    )
    rms = _clip_then(fo.chain(fo.scale_by_rms(), fo.scale_by_learning_rate(LR)))
    finite = fo.apply_if_finite(_adamw_chain(fo.add_decayed_weights(WD)), 3)
    clip_adamw = "clip_grad_norm_ + AdamW(fused)"
    clip_rmsprop = "clip_grad_norm_ + RMSprop(foreach)"
    return [
        ("adamw chain", "fo.Optimizer", lambda p, g: _ours_optimizer(adamw, p, g), clip_adamw,
         _torch_clip_adamw(list)),
        ("adamw chain", "tx.step", lambda p, g: _ours_tx_step(adamw, p, g), clip_adamw,
         _torch_clip_adamw(list)),
        ("lion chain", "fo.Optimizer", lambda p, g: _ours_optimizer(lion, p, g),
         "foreach Lion (written here)", _torch_lion),
        ("masked decay", "fo.Optimizer", lambda p, g: _ours_optimizer(masked, p, g),
         "clip + AdamW(fused), 2 groups", _torch_clip_adamw(_two_groups("weight_decay", 0.0))),
        ("multi_transform lr", "fo.Optimizer", lambda p, g: _ours_optimizer(multi, p, g),
         "clip + AdamW(fused), 2 groups", _torch_clip_adamw(_two_groups("lr", LR / 10))),
        ("rmsprop chain", "fo.Optimizer", lambda p, g: _ours_optimizer(rms, p, g), clip_rmsprop,
         _torch_clip_rmsprop),
        ("rmsprop chain", "tx.step", lambda p, g: _ours_tx_step(rms, p, g), clip_rmsprop,
         _torch_clip_rmsprop),
        ("finite adamw", "fo.Optimizer", lambda p, g: _ours_optimizer(finite, p, g),
         "AMP finite check + AdamW(fused)", _torch_finite_adamw),
        ("multisteps adamw", "fo.Optimizer, 4 calls", _ours_multi_steps,
         "4 foreach adds, mean, AdamW(fused)", _torch_accumulate_adamw),
        ("pure adam", "fo.adam update", lambda p, g: _ours_pure(fo.adam(lr=LR), p, g),
         "Adam(fused)", _torch_adam),
        ("pure adamw chain", "chain update", lambda p, g: _ours_pure(adamw, p, g),
         "Adam(fused)", _torch_adam),
        ("pure step adam", "fo.pure_step(fo.adam)",
         lambda p, g: _ours_pure_step(fo.adam(lr=LR), p, g), "Adam(fused)", _torch_adam),
        ("pure step adamw chain", "fo.pure_step(chain)",
         lambda p, g: _ours_pure_step(adamw, p, g), clip_adamw, _torch_clip_adamw(list)),
        ("alias adam", "fo.Optimizer(fo.adam)",
         lambda p, g: _ours_optimizer(fo.adam(lr=LR), p, g), "Adam(fused)", _torch_adam),
        ("alias adam", "FunctionalAdam.step", _functional_adam, "Adam(fused)", _torch_adam),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark and return its markdown table."""
    parser = benchmark_parser(__doc__, "1M params, few repeats")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default=None, help="comma-separated chain names")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    total = 1_000_000 if args.quick else 10_000_000
    repeats = args.repeats or (5 if args.quick else 11)
    rows: list[list[object]] = []
    selected = [r for r in _rows() if args.only is None or r[0] in args.only.split(",")]
    for n, skewed in MODELS:
        params, grads = _make(total, n, skewed)
        label = f"{n} skewed" if skewed else n
        for name, ours, build_ours, theirs, build_theirs in selected:
            steps = {"ours": build_ours(params, grads), "torch": build_theirs(params, grads)}
            with torch.no_grad():
                ms = interleaved_median_ms(steps, args.warmup, repeats)
            ratio = ms["ours"] / ms["torch"]
            rows.append(
                [
                    name,
                    label,
                    ours,
                    f"{ms['ours']:.2f}",
                    theirs,
                    f"{ms['torch']:.2f}",
                    f"{ratio:.2f}",
                ]
            )
            del steps
    lines = [
        f"### Chains in place and the pure path: {total / 1e6:g}M float32 params, "
        f"{args.threads} thread(s), median of {repeats} alternating rounds",
        "",
        *table(HEADERS, rows, "lrlrlrr"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
