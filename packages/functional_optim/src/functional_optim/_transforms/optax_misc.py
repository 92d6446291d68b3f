"""optax's small transforms: sign, trust ratio, noise, EMA, NaN zeroing, constraints.

``centralize``, ``scale_by_sign``, ``scale_by_trust_ratio``, ``set_to_zero``, ``zero_nans``,
``keep_params_nonnegative``, ``ema`` and ``add_noise``, with optax's names, defaults and
formulas. A ``None`` update stays ``None``. The clipping transforms live in
:mod:`functional_optim._transforms.clip`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, UpdateFn, init_empty
from functional_optim._lists import LeafView, ListTransform, foreach_scaled
from functional_optim._recipes import transform_factory
from functional_optim._shard_context import sharded_norms
from functional_optim._sharded_flags import each_any_over_shards
from functional_optim._transforms import _ops
from functional_optim._transforms._leaf import debias as debias_moment
from functional_optim._transforms._leaf import moment, safe_norm, store
from functional_optim._transforms._leafwise import leafwise_lists
from functional_optim._transforms._stateless import stateless
from functional_optim._tree import PyTree, tree_flatten, tree_zeros_like

__all__ = [
    "AddNoiseState",
    "EmaState",
    "NoiseKey",
    "ZeroNansState",
    "add_noise",
    "centralize",
    "ema",
    "keep_params_nonnegative",
    "noise_seed",
    "scale_by_sign",
    "scale_by_trust_ratio",
    "set_to_zero",
    "zero_nans",
]

Scalar = float | Tensor


class EmaState(NamedTuple):
    """State of :func:`ema`: per-param counts and the (not debiased) average."""

    count: PyTree
    ema: PyTree


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`: per param, whether its last update had a NaN (0-d bool)."""

    found_nan: PyTree


class AddNoiseState(NamedTuple):
    """State of :func:`add_noise`: the step count and the seed of the next draw (0-d int64)."""

    count: Tensor  # type: ignore[assignment]  # shadows tuple.count, as in optax
    rng_key: Tensor


def _with_params_lists(fn: Callable[[Tensor, Tensor], Tensor], key: str) -> ListTransform:
    """List maths of a stateless transform that reads the params: ``fn(u, p)`` per tensor."""

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        return [fn(u, p) for u, p in zip(updates, view.params, strict=True)], state

    return ListTransform(key, {}, apply, writes_updates=False)


def _with_params(fn: Callable[[Tensor, Tensor], Tensor], name: str) -> UpdateFn:
    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del inplace
        _ops.require_params(params, name)
        leaves, spec, (ps,) = _ops.flat(updates, params)
        out = [None if u is None else fn(u, p) for u, p in zip(leaves, ps, strict=True)]
        return spec.unflatten(out), state

    return update


@transform_factory
def centralize() -> GradientTransformation:
    """Subtract from each update of 2 or more dimensions its mean over all dimensions but the first
    (gradient centralization).

    Returns:
        A stateless ``GradientTransformation``.
    """

    def fn(u: Tensor) -> Tensor:
        if u.ndim < 2:
            return u
        return u - u.mean(dim=tuple(range(1, u.ndim)), keepdim=True)

    return stateless(fn, "centralize")


@transform_factory
def scale_by_sign() -> GradientTransformation:
    """Replace each update element by its sign (-1, 0 or 1).

    Returns:
        A stateless ``GradientTransformation``.
    """
    return stateless(torch.sign, "scale_by_sign", list_fn=lambda u: list(torch._foreach_sign(u)))


@transform_factory
def set_to_zero() -> GradientTransformation:
    """Replace every update by zeros (with :func:`masked`: freeze the masked params).

    Returns:
        A stateless ``GradientTransformation``.
    """
    return stateless(torch.zeros_like, "set_to_zero")


@transform_factory
def scale_by_trust_ratio(
    min_norm: Scalar = 0.0, trust_coefficient: Scalar = 1.0, eps: Scalar = 0.0
) -> GradientTransformation:
    """Scale each update by ``trust_coefficient * ||p|| / (||u|| + eps)`` (LARS/LAMB).

    Norms are clipped below at ``min_norm``; the ratio is 1 where either norm is 0.

    Args:
        min_norm: lower bound of both norms.
        trust_coefficient: multiplier of the ratio.
        eps: added to the update norm.

    Returns:
        A stateless ``GradientTransformation`` whose ``update`` needs ``params``.
    """

    def fn(u: Tensor, p: Tensor) -> Tensor:
        return scaled(u, safe_norm(p, float(min_norm)), safe_norm(u, float(min_norm)))

    def scaled(u: Tensor, p_norm: Tensor, u_norm: Tensor) -> Tensor:
        ratio = trust_coefficient * p_norm / (u_norm + eps)
        zero = torch.logical_or(p_norm == 0, u_norm == 0)
        return u * torch.where(zero, torch.ones_like(ratio), ratio)

    name = "scale_by_trust_ratio"
    local = _with_params_lists(fn, name)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        n, low = len(updates), float(min_norm)
        norms = sharded_norms([*view.params, *updates], [*view.params] * 2) if n else None
        if norms is None:  # not DTensor shards
            return local.apply(updates, state, view)
        safe = [
            x if low == 0.0 else torch.where(x <= low, torch.full_like(x, low), x) for x in norms
        ]
        return [scaled(u, safe[k], safe[n + k]) for k, u in enumerate(updates)], state

    lists = local._replace(apply=apply)
    return GradientTransformation(init_empty, _with_params(fn, name), lists=lists)


@transform_factory
def keep_params_nonnegative() -> GradientTransformation:
    """Change updates so that ``params + updates >= 0``: where it would go negative, the update
    becomes ``-params`` (the param lands on 0).

    Returns:
        A stateless ``GradientTransformation`` whose ``update`` needs ``params``.
    """

    def fn(u: Tensor, p: Tensor) -> Tensor:
        return torch.where(p + u < 0, -p, u)

    name = "keep_params_nonnegative"
    return GradientTransformation(
        init_empty, _with_params(fn, name), lists=_with_params_lists(fn, name)
    )


@transform_factory
def zero_nans() -> GradientTransformation:
    """Replace NaN update elements by 0 and record, per param, whether any was found.

    Returns:
        A ``GradientTransformation`` with state :class:`ZeroNansState`.
    """

    def init(params: PyTree) -> ZeroNansState:
        leaves, spec = tree_flatten(params)
        flags = [
            None if p is None else torch.zeros((), dtype=torch.bool, device=p.device)
            for p in leaves
        ]
        return ZeroNansState(spec.unflatten(flags))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(u: Tensor, found: Tensor) -> tuple[Tensor, Tensor]:
            nan = torch.isnan(u)
            return torch.where(nan, torch.zeros_like(u), u), store(found, nan.any(), inplace)

        return _ops.map_state(updates, state, ZeroNansState, leaf)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        nans = [torch.isnan(u) for u in updates]
        flags = each_any_over_shards([nan.any() for nan in nans], view.params)  # whole tensors
        for found, flag in zip(view.gather(state.found_nan), flags, strict=True):
            found.copy_(flag)
        out = [torch.where(n, torch.zeros_like(u), u) for u, n in zip(updates, nans, strict=True)]
        return out, state

    lists = ListTransform("zero_nans", {}, apply, writes_updates=False)
    return GradientTransformation(init, update, lists=lists)


@transform_factory
def ema(decay: Scalar, debias: bool = True) -> GradientTransformation:
    """Exponential moving average of the updates: ``ema = (1 - decay) * u + decay * ema``.

    The output is the average, divided by ``1 - decay**t`` when ``debias`` (the state keeps the
    raw average).

    Args:
        decay: the decay rate.
        debias: debias the output.

    Returns:
        A ``GradientTransformation`` with state :class:`EmaState`.
    """

    def init(params: PyTree) -> EmaState:
        return EmaState(_ops.zero_counts(params), tree_zeros_like(params))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params

        def leaf(u: Tensor, count: Tensor, avg: Tensor) -> tuple[Tensor, ...]:
            new = moment(u, avg, decay)
            count = _ops.increment(count, inplace)
            out = debias_moment(new, decay, count) if debias else new
            return out, count, store(avg, new, inplace)

        return _ops.map_state(updates, state, EmaState, leaf)

    lists = leafwise_lists("ema", {}, update)
    return GradientTransformation(init, update, lists=lists)


#: What :func:`add_noise` takes as its ``key``: an int seed, a one-element integer tensor, or a
#: ``torch.Generator`` to draw the seed from.
NoiseKey = int | Tensor | torch.Generator


@torch.compiler.disable  # type: ignore[untyped-decorator]  # a seeded Generator: eager
def _gaussian_draws(rng_key: Tensor, like: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """Standard normal noise shaped like each tensor of ``like`` (in order, on a CPU generator
    seeded with ``rng_key``) and the next key drawn after them."""
    gen = torch.Generator().manual_seed(int(rng_key))
    noise = [torch.randn(u.shape, generator=gen, dtype=u.dtype).to(u.device) for u in like]
    return noise, torch.randint(0, 2**62, (), generator=gen, dtype=torch.int64)


def noise_seed(
    key: NoiseKey | None, seed: NoiseKey | None = None, *, name: str = "add_noise"
) -> int:
    """The seed of the first draw of :func:`add_noise` from optax's ``key`` and ``seed``.

    ``seed`` is the older name of ``key`` (kept, without a warning); a ``torch.Generator`` gives
    one seed drawn from it (advancing it: one generator seeds several transforms differently,
    and reproducibly when it was seeded); neither gives 0 (optax's default key).

    Args:
        key: the key (optax's name).
        seed: the same, by its older name.
        name: the function named in the errors.

    Returns:
        The seed, an int in ``[0, 2**62)`` for a generator.

    Raises:
        TypeError: if both are given, or the key is not an integer, a one-element integer
            tensor or a ``torch.Generator``.
    """
    if key is not None and seed is not None:
        raise TypeError(
            f"{name} takes key= or seed= (its older name), not both: got key={key!r} and "
            f"seed={seed!r}"
        )
    value = key if key is not None else seed
    if value is None:
        return 0
    if isinstance(value, torch.Generator):
        drawn = torch.randint(0, 2**62, (), generator=value, device=value.device)
        return int(drawn)
    if isinstance(value, Tensor):
        if (
            value.numel() != 1
            or value.is_floating_point()
            or value.is_complex()
            or (value.dtype == torch.bool)
        ):
            raise TypeError(
                f"{name}'s key must be an int, a torch.Generator or a one-element integer "
                f"tensor, got a {value.dtype} tensor of shape {tuple(value.shape)}"
            )
        return int(value.item())
    given: object = value  # checked at run time whatever the annotation says
    if isinstance(given, bool) or not isinstance(given, numbers.Integral):
        raise TypeError(
            f"{name}'s key must be an int, a torch.Generator or a one-element integer tensor, "
            f"got {type(given).__name__}"
        )
    return int(given)


@transform_factory
def add_noise(
    eta: Scalar, gamma: Scalar, key: NoiseKey | None = None, *, seed: NoiseKey | None = None
) -> GradientTransformation:
    """Add Gaussian noise of variance ``eta / t**gamma`` (``t`` = 1, 2, ...) to every update.

    The noise comes from a ``torch.Generator`` seeded from the state's ``rng_key`` (one draw per
    update leaf, then the next key), so a state replays the same noise; optax draws from JAX's
    PRNG, so the distribution matches optax and the samples do not. Under ``torch.func.vmap`` use
    ``randomness="same"`` (or ``"different"``).

    Args:
        eta: base variance.
        gamma: decay exponent of the variance.
        key: seed of the first draw (optax's ``key``): an int, a one-element integer tensor or a
            ``torch.Generator`` to draw it from (see :func:`noise_seed`); None: 0.
        seed: the older name of ``key`` (keyword-only, as in optax; give one of the two).

    Returns:
        A ``GradientTransformation`` with state :class:`AddNoiseState`.

    Raises:
        TypeError: if both ``key`` and ``seed`` are given, or the key has another type.
    """
    first = noise_seed(key, seed)

    def init(params: PyTree) -> AddNoiseState:
        del params
        count = torch.zeros((), dtype=torch.int64)
        return AddNoiseState(count, torch.tensor(first, dtype=torch.int64))

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        del params
        count = _ops.increment(state.count, inplace)
        std = torch.sqrt(eta / count.to(torch.float64) ** gamma)
        leaves, spec = tree_flatten(updates)
        present = [u for u in leaves if u is not None]
        noises, next_key = _gaussian_draws(state.rng_key, present)
        drawn = iter(noises)
        out: list[Tensor | None] = [
            None if u is None else u + _ops.like(std, u) * next(drawn) for u in leaves
        ]
        rng_key = state.rng_key.copy_(next_key) if inplace else next_key
        return spec.unflatten(out), AddNoiseState(count, rng_key)

    def draw(updates: list[Tensor], state: OptState, inplace: bool) -> tuple[list[Tensor], Any]:
        """``update``'s maths over a list: the same draws in the same order, then
        ``u + std * noise`` in one ``_foreach`` call per dtype (new tensors)."""
        count = _ops.increment(state.count, inplace)
        std = torch.sqrt(eta / count.to(torch.float64) ** gamma)
        noise, next_key = _gaussian_draws(state.rng_key, updates)
        out = foreach_scaled(noise, std)
        if out:
            torch._foreach_add_(out, updates)
        rng_key = state.rng_key.copy_(next_key) if inplace else next_key
        return out, AddNoiseState(count, rng_key)

    def apply(updates: list[Tensor], state: OptState, view: LeafView) -> tuple[list[Tensor], Any]:
        del view
        return draw(updates, state, inplace=True)

    def apply_pure(
        updates: list[Tensor], state: OptState, view: LeafView
    ) -> tuple[list[Tensor], Any]:
        del view
        return draw(updates, state, inplace=False)

    hyper = {"eta": eta, "gamma": gamma, "seed": first}
    lists = ListTransform("add_noise", hyper, apply, False, apply_pure)
    return GradientTransformation(init, update, lists=lists)
