"""What one registry entry declares about an algorithm (:class:`Algorithm`, :class:`Hyperparam`).

The entries themselves live in :mod:`functional_optim._registry`; this module holds their type
and builds what an entry generates: the fused ``step`` from the kernel's declared argument
order (:mod:`functional_optim._aliases._kernel_step`) and, for an entry that declares its
hyperparameters instead of naming a hand-written alias, the alias itself.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from functional_optim._aliases._kernel_spec import InputCheck, KernelArg, KernelSpec
from functional_optim._aliases._kernel_step import AUTO, KernelPath, with_kernel
from functional_optim._base import GradientTransformation
from functional_optim._step_checks import GradRules, SparsePolicy
from functional_optim._transforms.hyperparams import inject_hyperparams

__all__ = ["Algorithm", "Hyperparam"]

Alias = Callable[..., GradientTransformation]


@dataclass(frozen=True)
class Hyperparam:
    """One hyperparameter of a generated alias.

    Attributes:
        name: torch's argument name (``"lr"``).
        default: torch's default.
        check: raises torch's exception for a bad value (called before anything is built).
        keyword_only: the argument is keyword-only (torch's ``maximize``).
        cases: values the parity tests try besides ``default`` (booleans try both anyway).
    """

    name: str
    default: Any
    check: Callable[[Any], None] | None = None
    keyword_only: bool = False
    cases: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Algorithm:
    """Everything about one torch.optim algorithm: the one place it is declared.

    Attributes:
        name: the alias's name (``"adam"``).
        torch_name: the ``torch.optim`` class name (``"Adam"``).
        transform: the state transform the alias is built around (``scale_by_adam``).
        state_type: the NamedTuple state of ``transform``.
        state_names: for each state type the alias's chain holds, field -> torch state key.
        kernel: the dispatching kernel (``kernels.adam``); None when there is none.
        kernel_args: the kernel's arguments in order (see
            :mod:`functional_optim._aliases._kernel_step`); the alias's fused ``step`` is built
            from it.
        check_inputs: run on the active params and grads before the kernel.
        functional: the TorchScript ``FunctionalX`` class, None when not scriptable.
        alias: the optimizer factory (torch's hyperparameter names and defaults). Leave it None
            and declare ``hyperparams`` and ``chain`` to have it generated.
        hyperparams: the generated alias's arguments, in torch's order.
        chain: builds the generated alias's chain from the checked hyperparameters (by name).
        has_fused: torch has a fused CPU kernel (the alias's ``step`` then matches
            ``fused=True`` bitwise; else ``foreach=False``).
        sparse_grads: takes sparse (COO) gradients only (SparseAdam).
        takes_sparse: takes sparse gradients as well as dense ones (torch's SGD, Adagrad);
            otherwise a sparse gradient raises ``sparse_message`` before the step changes
            anything.
        sparse_message: torch's message for a refused sparse (or, with ``sparse_grads``,
            dense) gradient; ``"<torch_name> does not support sparse gradients"`` when empty.
        promotes: torch's per-tensor path computes with gradients (and state) of another
            dtype than their param (SGD's ``param.add_(grad)``): the step runs the kernel's
            ``"single"`` path for them. Otherwise they raise before the step changes anything.
        one_dtype_when: a hyperparameter that turns ``promotes`` off when true (RMSprop's
            ``centered``: torch's ``lerp_`` takes one dtype).
        needs_closure: ``step`` takes a closure in place of the gradients (LBFGS); driven by
            ``fo.Optimizer.step(closure)``.
        elementwise: each element's update reads only that element's gradient and state (no
            norm, factor or line search), so a param may be split anywhere: ZeRO's flat
            partition takes ``torch.optim.<torch_name>`` (``dist_runtime.flat_shards``).
        torch_only_args: torch constructor arguments a generated alias leaves out
            (implementation switches such as ``foreach``; the built-in aliases take them all).
        doc: the generated alias's docstring.
    """

    name: str
    torch_name: str
    transform: Callable[..., GradientTransformation]
    state_type: type
    state_names: Mapping[type, Mapping[str, str]]
    kernel: Callable[..., None] | None = None
    kernel_args: tuple[KernelArg, ...] = ()
    check_inputs: InputCheck | None = None
    functional: type | None = None
    alias: Alias | None = None
    hyperparams: tuple[Hyperparam, ...] = ()
    chain: Alias | None = None
    has_fused: bool = False
    sparse_grads: bool = False
    takes_sparse: bool = False
    sparse_message: str = ""
    promotes: bool = False
    one_dtype_when: str | None = None
    needs_closure: bool = False
    elementwise: bool = False
    torch_only_args: frozenset[str] = field(
        default=frozenset({"foreach", "capturable", "differentiable", "fused"})
    )
    doc: str = ""

    def __post_init__(self) -> None:
        if self.alias is None:
            if self.chain is None or not self.hyperparams:
                raise ValueError(
                    f"{self.name}: give either alias= or hyperparams= and chain= (to generate it)"
                )
            object.__setattr__(self, "alias", _generated_alias(self))

    @property
    def grad_rules(self) -> GradRules:
        """What the step takes besides dense gradients of the params' dtype (checked by every
        step, :func:`functional_optim._step_checks.check_step`)."""
        sparse: SparsePolicy = "refuse"
        if self.sparse_grads:
            sparse = "require"
        elif self.takes_sparse:
            sparse = "accept"
        return GradRules(
            self.torch_name, sparse, self.sparse_message, self.promotes, self.one_dtype_when
        )

    @functools.cached_property
    def kernel_spec(self) -> KernelSpec | None:
        """The kernel and its argument order; None without a kernel (built once per entry)."""
        if self.kernel is None:
            return None
        return KernelSpec(
            self.kernel,
            self.kernel_args,
            self.state_type,
            self.check_inputs,
            self.grad_rules,
            self.state_names,
        )

    def fused(
        self, tx: GradientTransformation, *, path: KernelPath = AUTO, **values: Any
    ) -> GradientTransformation:
        """``tx`` with the fused ``step`` of this entry's kernel: what a hand-written alias's
        builder returns.

        Args:
            tx: the alias's chain.
            path: the kernel path torch's flags chose
                (:func:`functional_optim._aliases._common.kernel_path`).
            values: the hyperparameters its kernel arguments name.

        Raises:
            ValueError: if the entry declares no kernel.
        """
        spec = self.kernel_spec
        if spec is None:
            raise ValueError(f"the {self.name!r} entry declares no kernel")
        return with_kernel(tx, spec, values, path)


def _signature(hyperparams: tuple[Hyperparam, ...]) -> inspect.Signature:
    kinds = {
        False: inspect.Parameter.POSITIONAL_OR_KEYWORD,
        True: inspect.Parameter.KEYWORD_ONLY,
    }
    return inspect.Signature(
        [inspect.Parameter(h.name, kinds[h.keyword_only], default=h.default) for h in hyperparams]
    )


def _generated_alias(algorithm: Algorithm) -> Alias:
    """``algorithm``'s alias: checks each hyperparameter, builds ``chain(**hyperparams)`` and
    gives it the fused ``step`` of the entry's kernel; injected like every alias."""
    signature = _signature(algorithm.hyperparams)
    checks = [(h.name, h.check) for h in algorithm.hyperparams if h.check is not None]
    chain = algorithm.chain
    assert chain is not None
    spec = algorithm.kernel_spec
    needed = sorted(spec.hyperparameter_names()) if spec is not None else []

    def build(**hyperparams: Any) -> GradientTransformation:
        for arg, check in checks:
            check(hyperparams[arg])
        tx = chain(**hyperparams)
        if spec is None:
            return tx
        return with_kernel(tx, spec, {k: hyperparams[k] for k in needed})

    build.__signature__ = signature  # type: ignore[attr-defined]

    def alias(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return inject_hyperparams(build)(**bound.arguments)

    alias.__signature__ = signature  # type: ignore[attr-defined]
    alias.__name__ = alias.__qualname__ = algorithm.name
    alias.__doc__ = algorithm.doc or f"{algorithm.torch_name} (generated from its registry entry)."
    alias.__module__ = "functional_optim._registry"
    return alias
