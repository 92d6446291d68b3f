"""DiLoCo's outer step over fragments: synced copies, outer-optimizer states, error feedback.

For each fragment (a run of parameters, see :mod:`dist_runtime.fragment_plan`) this keeps the
parameters as of its last sync ``s`` (one flat buffer), the state of the outer optimizer (any
``functional_optim.GradientTransformation``) over those parameters, and the error feedback of a
compressed all-reduce. A sync computes the pseudo-gradient ``s - x`` from the local parameters
``x``, starts its mean over the group (:mod:`dist_runtime.pseudo_gradient`) and, when applied,
runs the outer optimizer on ``s`` with that mean as the gradient and writes the result into the
parameters, blended with the local values by ``alpha`` (Streaming DiLoCo's merge;
``alpha = 0`` overwrites them, as DiLoCo does).

A mean whose collective fails (a dead or hung peer) is dropped (:meth:`OuterSync.drop_failed`):
its fragment keeps its synced copy, outer state and error feedback as before the send, and is
sent again at its next slot (or by a retry of the same step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from dist_runtime.pseudo_gradient import PendingMean, PseudoGradientReducer
from functional_optim import GradientTransformation, OptState, apply_updates

__all__ = ["FragmentSync", "OuterSync"]


def _flat_copy(params: Sequence[Tensor]) -> Tensor:
    """The parameters concatenated (``torch.cat`` promotes mixed dtypes)."""
    return torch.cat([p.detach().reshape(-1) for p in params])


def _views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like ``params``, in order."""
    out: list[Tensor] = []
    offset = 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


def _state_leaves(state: OptState) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten an outer-optimizer state as functional_optim does (``None`` buffers are leaves,
    so the layout is the same before and after a momentum buffer is first filled)."""
    leaves, spec = optree.tree_flatten(state, none_is_leaf=True, namespace="functional_optim")
    return leaves, spec


def _clone_leaf(leaf: Any) -> Any:
    return leaf.detach().clone() if isinstance(leaf, Tensor) else leaf


class FragmentSync:
    """The sync state of one fragment.

    Args:
        indices: positions of the fragment's parameters in the averaged list.
        params: the fragment's parameters (their current values become the synced copy).
        outer: the outer optimizer.
    """

    def __init__(
        self, indices: Sequence[int], params: Sequence[Tensor], outer: GradientTransformation
    ) -> None:
        self.indices = list(indices)
        self.synced = _flat_copy(params).clone()
        self.synced_views = _views(self.synced, params)
        self.outer_state: OptState = outer.init(self.synced_views)
        self.residual: Tensor | None = None
        self.delta: Tensor | None = None
        self.pending: PendingMean | None = None
        self.apply_at: int | None = None


class OuterSync:
    """Outer synchronisation of a list of parameters split into fragments.

    Build it once every rank holds the same parameter values (the averager averages them
    first); from then on the synced copies stay identical on every rank.

    Args:
        params: the parameters, in the order every later call passes them.
        plan: the parameter indices of each fragment.
        outer: the outer optimizer, applied to the synced copy with the mean pseudo-gradient.
        reducer: starts the group means and counts the bytes.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        plan: Sequence[Sequence[int]],
        outer: GradientTransformation,
        reducer: PseudoGradientReducer,
    ) -> None:
        self.outer = outer
        self.reducer = reducer
        self._shapes = [(p.shape, p.dtype) for p in params]
        self.fragments = [
            FragmentSync(indices, [params[i] for i in indices], outer) for indices in plan
        ]

    def check_params(self, params: Sequence[Tensor]) -> None:
        """Check that ``params`` match the parameters the sync state was built for.

        Raises:
            RuntimeError: if their number, shapes or dtypes changed.
        """
        now = [(p.shape, p.dtype) for p in params]
        if now != self._shapes:
            raise RuntimeError(
                f"the parameters to average changed since the first sync ({len(self._shapes)} "
                f"then, {len(now)} now, or other shapes/dtypes): DiLoCo keeps a synced copy of "
                "each parameter. Pass the same parameters every step (all with a gradient), or "
                "build a new averager."
            )

    def send(self, index: int, params: Sequence[Tensor], apply_at: int) -> None:
        """Compute fragment ``index``'s pseudo-gradient ``s - x`` and start its group mean.

        Args:
            index: the fragment.
            params: all the parameters.
            apply_at: the averager step at which :meth:`apply` will be called for it.
        """
        fragment = self.fragments[index]
        if fragment.pending is not None:
            raise RuntimeError(f"fragment {index} is sent again before its outer step ran")
        # The pseudo-gradient buffer is reused at every send of this fragment (it is free
        # again once the previous send was applied): no fresh allocation per sync.
        if fragment.delta is None:
            fragment.delta = torch.empty_like(fragment.synced)
        delta = fragment.delta
        for view, i in zip(_views(delta, fragment.synced_views), fragment.indices, strict=True):
            view.copy_(params[i].detach())
        torch.sub(fragment.synced, delta, out=delta)
        fragment.pending, fragment.residual = self.reducer.start(
            delta, fragment.residual, key=index
        )
        fragment.apply_at = apply_at

    def wait(self, index: int) -> None:
        """Wait for fragment ``index``'s mean (kept for :meth:`apply`); nothing else changes.

        Raises:
            RuntimeError: if its collective failed (then :meth:`drop_failed`).
        """
        pending = self.fragments[index].pending
        assert pending is not None
        pending.wait()

    def drop_failed(self) -> list[int]:
        """Let every collective in flight end; drop the means whose collective failed.

        A dropped fragment is as before its send (error feedback restored, nothing pending):
        it is sent again at its next slot. Means that arrived are kept for :meth:`apply`.

        Returns:
            The dropped fragments.
        """
        dropped = []
        for index, fragment in enumerate(self.fragments):
            pending = fragment.pending
            if pending is not None and not pending.settle():
                pending.discard()
                fragment.pending, fragment.apply_at = None, None
                dropped.append(index)
        return dropped

    def due(self, step: int) -> list[int]:
        """The fragments whose outer step is due at averager step ``step``."""
        return [
            i for i, f in enumerate(self.fragments) if f.pending is not None and f.apply_at == step
        ]

    @torch.no_grad()
    def apply(self, index: int, params: Sequence[Tensor], alpha: float) -> None:
        """Wait for fragment ``index``'s mean, run the outer step, write the parameters.

        Args:
            index: the fragment.
            params: all the parameters.
            alpha: weight of the local values in ``x = alpha * x + (1 - alpha) * s``.
        """
        fragment = self.fragments[index]
        assert fragment.pending is not None
        mean = fragment.pending.wait()
        fragment.pending, fragment.apply_at = None, None
        grads = _views(mean, fragment.synced_views)
        if self.outer.step is not None:
            fragment.outer_state = self.outer.step(
                fragment.synced_views, grads, fragment.outer_state
            )
        else:
            updates, fragment.outer_state = self.outer.update(
                grads, fragment.outer_state, fragment.synced_views, inplace=True
            )
            apply_updates(fragment.synced_views, updates, inplace=True)
        for i, synced in zip(fragment.indices, fragment.synced_views, strict=True):
            p = params[i]
            if alpha == 0.0:
                p.copy_(synced)
            else:
                p.mul_(alpha).add_(synced.to(p.dtype), alpha=1.0 - alpha)

    def wait_all(self) -> None:
        """Finish every in-flight collective (their results are kept for :meth:`apply`)."""
        for fragment in self.fragments:
            if fragment.pending is not None:
                fragment.pending.wait()

    def state_dict(self) -> list[dict[str, Any]]:
        """Each fragment's synced copy, outer state, error feedback and pending mean (copies).

        In-flight collectives are waited for, so that their result is saved.
        """
        out = []
        for fragment in self.fragments:
            leaves, _ = _state_leaves(fragment.outer_state)
            pending = fragment.pending.wait().clone() if fragment.pending is not None else None
            out.append(
                {
                    "indices": list(fragment.indices),
                    "synced": fragment.synced.clone(),
                    "outer_state": [_clone_leaf(leaf) for leaf in leaves],
                    "residual": None if fragment.residual is None else fragment.residual.clone(),
                    "pending_mean": pending,
                    "apply_at": fragment.apply_at,
                }
            )
        return out

    def load_state_dict(self, state: Sequence[dict[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output (values are copied in).

        Raises:
            ValueError: if the fragments, sizes or outer-state layout do not match.
        """
        if len(state) != len(self.fragments):
            raise ValueError(
                f"the state has {len(state)} fragments, this averager {len(self.fragments)}"
            )
        for i, (fragment, saved) in enumerate(zip(self.fragments, state, strict=True)):
            if list(saved["indices"]) != fragment.indices:
                raise ValueError(f"fragment {i} holds other parameters in the saved state")
            synced = saved["synced"]
            if synced.shape != fragment.synced.shape or synced.dtype != fragment.synced.dtype:
                raise ValueError(
                    f"fragment {i}'s synced copy is {tuple(synced.shape)} {synced.dtype} in the "
                    f"saved state, {tuple(fragment.synced.shape)} {fragment.synced.dtype} here"
                )
            leaves, spec = _state_leaves(fragment.outer_state)
            if len(saved["outer_state"]) != len(leaves):
                raise ValueError(
                    f"fragment {i}'s outer-optimizer state has {len(saved['outer_state'])} "
                    f"leaves in the saved state, {len(leaves)} here: use the same outer optimizer"
                )
            fragment.synced.copy_(synced)
            device = fragment.synced.device
            fragment.outer_state = optree.tree_unflatten(
                spec,
                [
                    leaf.detach().clone().to(device) if isinstance(leaf, Tensor) else leaf
                    for leaf in saved["outer_state"]
                ],
            )
            residual = saved["residual"]
            fragment.residual = None if residual is None else residual.clone().to(device)
            pending = saved["pending_mean"]
            fragment.pending = None if pending is None else PendingMean.done(pending.clone())
            fragment.apply_at = saved["apply_at"]
