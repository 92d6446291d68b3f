"""Checkpoint loaders refuse pickled objects: nothing from a checkpoint runs on load."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from dist_runtime.dcp_state import read_meta, shard_meta
from dist_runtime.safe_load import UnsafeCheckpointError, dump_plain, load_plain
from dist_runtime.sharded_checkpoint import (
    load_plain_optimizer,
    save_optimizer_shards,
    whole_param_pieces,
)

RAN: list[str] = []


def _payload(tag: str) -> None:
    """What a malicious checkpoint would run (here: leave a trace)."""
    RAN.append(tag)


class Evil:
    """An object whose unpickling calls :func:`_payload`."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_payload, (self.tag,))


def _optimizer() -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2, generator=gen)) for _ in range(2)]
    optim = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.99))
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    optim.step()
    return optim, params


def _save(root: Path, **extra: Any) -> str:
    optim, params = _optimizer()
    pieces = whole_param_pieces(optim.param_groups)
    return save_optimizer_shards(
        str(root), optim, pieces, params, optim.param_groups, extra=extra or None
    )


def _write_with_meta(root: Path, meta: bytes) -> str:
    """A checkpoint like ours whose ``meta`` entry is ``meta``."""
    optim, params = _optimizer()
    folder = os.path.join(root, "ckpt-000000")
    state = {"meta": meta, "state.0.exp_avg": optim.state[params[0]]["exp_avg"].reshape(-1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
    return folder


def test_round_trip_uses_plain_data(tmp_path: Path) -> None:
    folder = _save(tmp_path, epoch=3, weights=torch.ones(2))
    fresh, _ = _optimizer()
    fresh.state.clear()
    extra: dict[str, Any] = {"epoch": None, "weights": torch.zeros(2)}
    meta = load_plain_optimizer(folder, fresh, extra)
    assert meta["version"] == 3
    assert extra["epoch"] == 3
    assert torch.equal(extra["weights"], torch.ones(2))
    assert fresh.param_groups[0]["betas"] == (0.8, 0.99)
    reference, ref_params = _optimizer()
    for p, q in zip(fresh.param_groups[0]["params"], ref_params):
        assert torch.equal(fresh.state[p]["exp_avg"], reference.state[q]["exp_avg"])
    # meta itself is plain data: weights_only loads it.
    params = [torch.zeros(2)]
    raw = shard_meta(params, [{"params": params, "lr": torch.tensor(0.1)}])
    assert load_plain(raw, "meta")["numels"] == [2]


def test_meta_carrying_code_is_refused(tmp_path: Path) -> None:
    RAN.clear()
    for i, raw in enumerate(
        [dump_plain({"version": 3, "x": Evil("new")}), pickle.dumps(Evil("v2"))]
    ):
        folder = _write_with_meta(tmp_path / str(i), raw)
        fresh, _ = _optimizer()
        with pytest.raises(UnsafeCheckpointError, match="trusted storage"):
            load_plain_optimizer(folder, fresh)
        with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
            read_meta(raw)
    assert RAN == [], "code from the checkpoint ran"


def test_extra_entry_carrying_code_is_refused(tmp_path: Path) -> None:
    RAN.clear()
    folder = _save(tmp_path, hook=Evil("extra"))
    fresh, _ = _optimizer()
    with pytest.raises(UnsafeCheckpointError, match=r"checkpoint entry 'extra\.hook'.*_payload"):
        load_plain_optimizer(folder, fresh, {"hook": None})
    assert RAN == []


def test_dcp_metadata_carrying_code_is_refused(tmp_path: Path) -> None:
    RAN.clear()
    folder = _save(tmp_path)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Evil("metadata"), f)
    fresh, _ = _optimizer()
    with pytest.raises(UnsafeCheckpointError, match=r"references tests\..*_payload"):
        load_plain_optimizer(str(tmp_path), fresh)
    assert RAN == []
    # The unsafe path would have run it: the test payload is real.
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        pickle.load(f)
    assert RAN == ["metadata"]


# -- the examples' elastic resume reads checkpoints through the same safe loaders ----------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _touch(path: str) -> None:
    """What a malicious checkpoint would run in a worker process: leave a file behind."""
    Path(path).write_text("ran")


class EvilFile:
    """An object whose unpickling calls :func:`_touch` (visible across processes)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_touch, (self.path,))


def _commit_evil_metadata(root: Path, marker: Path) -> str:
    """A committed checkpoint under ``root`` whose DCP ``.metadata`` runs :func:`_touch`."""
    folder = root / "ckpt-000000"
    folder.mkdir(parents=True)
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(EvilFile(str(marker)), f)
    (root / "LATEST").write_text("ckpt-000000")
    return str(folder)


def test_example_checkpoint_readers_refuse_code_in_metadata(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(EXAMPLES))
    try:
        from _elastic import read_checkpoint_tensors, saved_keys
        from _nested_state import saved_like
    finally:
        sys.path.remove(str(EXAMPLES))
    marker = tmp_path / "ran"
    folder = _commit_evil_metadata(tmp_path / "root", marker)
    for read in (saved_keys, read_checkpoint_tensors):
        with pytest.raises(UnsafeCheckpointError, match=r"references tests\..*_touch"):
            read(folder)
    with pytest.raises(UnsafeCheckpointError, match="refusing to load"):
        saved_like(str(tmp_path / "root"), "inner.")
    assert not marker.exists(), "code from the checkpoint's .metadata ran"


def _resume_example(rank: int, world_size: int, example: str, root: str, marker: str) -> str:
    """Start ``example``'s elastic mode on ``root`` (holding a malicious checkpoint)."""
    import signal
    import sys

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from _common import TrainConfig
    from _elastic import ElasticOptions

    cfg = TrainConfig(epochs=1, batch_size=32, lr=1e-3, hidden=8, seed=0, max_steps=2, timeout_s=60)
    options = ElasticOptions(root, 10, 1.0, 0.0)
    import train_diloco
    import train_zero

    runs = {
        "train_zero": lambda: train_zero.run_zero_elastic(cfg, options),
        "train_diloco": lambda: train_diloco.run_diloco_elastic(cfg, 1, 4, 2, "streaming", options),
    }
    previous = signal.getsignal(signal.SIGTERM)  # the run installs its own SIGTERM handler
    try:
        with pytest.raises(UnsafeCheckpointError) as info:
            runs[example]()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not Path(marker).exists(), f"{example}: code from the checkpoint ran on resume"
    return str(info.value)


@pytest.mark.distributed
@pytest.mark.parametrize("example", ["train_zero", "train_diloco"])
def test_example_resume_refuses_code_in_metadata(example: str, tmp_path: Path) -> None:
    """The ``--checkpoint-dir`` resume of the examples reads ``.metadata`` with the safe reader."""
    from tests._world import World

    marker = tmp_path / "ran"
    _commit_evil_metadata(tmp_path / "root", marker)
    with World(1) as world:
        (text,) = world.run(_resume_example, example, str(tmp_path / "root"), str(marker))
    assert "trusted storage" in text
    assert not marker.exists()
