"""The overlap mode's failure policy in one process: work still in flight is settled first.

When a collective fails in the DDP ZeRO hooks, a bucket step running in a future callback, or a
broadcast still receiving, may write into the parameters after the failure surfaced.
:meth:`OverlapController.guarded` waits for all of the iteration's work (ignoring its errors)
before restoring the snapshot. Here a "late" future writes into a parameter 0.2 s after the
injected failure; the restored parameter must still be the pre-iteration one. No process group:
the error cannot name a rank and says "a peer ... (could not tell which)".
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from compat_api._zero.overlap import OverlapInfo
from compat_api._zero.overlap_control import OverlapController
from compat_api._zero.step_guard import OVERLAP_STEP, StepGuard
from dist_runtime.collective_failure import CollectiveFailedError

LATE_S = 0.2


class _FailedWork:
    """A broadcast handle whose wait fails (as a timed-out gloo work does)."""

    def wait(self) -> None:
        raise RuntimeError("[gloo] Timed out waiting 3000ms for recv operation")


def _controller(undo: bool) -> tuple[OverlapController, torch.nn.Parameter, Any]:
    param = torch.nn.Parameter(torch.arange(4.0))
    param.grad = torch.ones(4)
    optim = torch.optim.SGD([param], lr=0.5, momentum=0.9)
    optim.step()  # momentum state to restore
    zero = SimpleNamespace(
        optim=optim,
        process_group=None,
        undo_step_on_failure=undo,
        _step_guard=StepGuard(),
        strategy=SimpleNamespace(written_tensors=lambda zero: [param]),
    )
    return OverlapController(zero, OverlapInfo(world_size=2)), param, optim  # type: ignore[arg-type]


def _late_step(param: torch.Tensor, optim: torch.optim.Optimizer) -> torch.futures.Future[Any]:
    """A bucket step that lands LATE_S seconds after the failure (a future callback's)."""
    fut: torch.futures.Future[Any] = torch.futures.Future()

    def land() -> None:
        threading.Event().wait(LATE_S)
        optim.step()
        fut.set_result(param)

    threading.Thread(target=land, daemon=True).start()
    return fut


def _hook_call_that_fails(controller: OverlapController, late: torch.futures.Future[Any]) -> None:
    """A hook call whose collective fails while a step and a broadcast are still in flight."""
    with controller.guarded():
        controller.info.bucket_index_to_future[0] = late
        controller.info.broadcast_handles.append(_FailedWork())  # type: ignore[arg-type]
        controller.info.bucket_indices_seen.append(0)
        raise RuntimeError("[gloo] Connection reset by peer")


def _hook_call_with_a_bug(controller: OverlapController, param: torch.Tensor) -> None:
    """A hook call that writes, then fails for a reason other than a collective."""
    with controller.guarded():
        controller.info.bucket_indices_seen.append(3)
        with torch.no_grad():
            param.add_(1.0)
        raise AssertionError("Bucket indices are not in incremental order")


@pytest.mark.parametrize("undo", [True, False])
def test_failure_settles_in_flight_work_then_restores(undo: bool) -> None:
    controller, param, optim = _controller(undo)
    before = param.detach().clone()
    momentum = optim.state[param]["momentum_buffer"].clone()
    controller.begin_iteration()
    with pytest.raises(CollectiveFailedError) as failure:
        _hook_call_that_fails(controller, _late_step(param, optim))
    text = str(failure.value)
    assert text.startswith(f"{OVERLAP_STEP} failed: a peer"), text
    assert not controller.info.bucket_index_to_future
    assert not controller.info.broadcast_handles
    assert not controller.info.bucket_indices_seen
    threading.Event().wait(2 * LATE_S)  # the late step has landed by now, settled or not
    if undo:
        assert "as they were before the call" in text, text
        assert torch.equal(param, before), "the late step must land before the restore"
        assert torch.equal(optim.state[param]["momentum_buffer"], momentum)
    else:
        assert "may be partially updated" in text, text
        assert not torch.equal(param, before)


def test_other_errors_pass_through_and_forget_the_iteration() -> None:
    controller, param, _ = _controller(True)
    controller.begin_iteration()
    with pytest.raises(AssertionError, match="Bucket indices"):
        _hook_call_with_a_bug(controller, param)
    assert not controller.info.bucket_indices_seen
    assert torch.equal(param, torch.arange(4.0) + 1.0 - 0.5), "nothing restored"
