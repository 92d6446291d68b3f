"""dist_runtime.buckets: flat (device, rank) buckets whose views are the parameters' data."""

from __future__ import annotations

import pytest
import torch

from dist_runtime.buckets import build_rank_buckets, flatten_into_bucket, params_by_device


def _inside(tensor: torch.Tensor, bucket: torch.Tensor) -> bool:
    start = bucket.data_ptr()
    end = start + bucket.numel() * bucket.element_size()
    return start <= tensor.data_ptr() < end


def test_params_by_device_keeps_order_and_devices() -> None:
    cpu = [torch.zeros(i + 1) for i in range(4)]
    meta = [torch.zeros(3, device="meta"), torch.zeros(2, device="meta")]
    by_device = params_by_device([[cpu[0], meta[0], cpu[1]], [meta[1], cpu[2], cpu[3]]])
    assert list(by_device) == [torch.device("cpu"), torch.device("meta")]
    assert by_device[torch.device("cpu")] == [[cpu[0], cpu[1]], [cpu[2], cpu[3]]]
    assert by_device[torch.device("meta")] == [[meta[0]], [meta[1]]]
    assert params_by_device([[], []]) == {}


def test_flatten_into_bucket_makes_views() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    transposed = torch.nn.Parameter(torch.randn(4, 2).t())  # non-contiguous data
    params.append(transposed)
    before = [p.detach().clone() for p in params]
    bucket = flatten_into_bucket(params, torch.device("cpu"))
    assert bucket.shape == (12 + 5 + 8,)
    assert torch.equal(bucket, torch.cat([b.reshape(-1) for b in before]))
    for param, old in zip(params, before):
        assert torch.equal(param, old)
        assert param.shape == old.shape
        assert _inside(param, bucket)
    # Writes through a parameter land in the bucket and the other way round.
    with torch.no_grad():
        params[1].add_(1.0)
    assert torch.equal(bucket[12:17], before[1] + 1.0)
    bucket.zero_()
    assert all(torch.count_nonzero(p) == 0 for p in params)


def test_flatten_into_bucket_errors() -> None:
    with pytest.raises(ValueError, match="at least one parameter"):
        flatten_into_bucket([], torch.device("cpu"))
    with pytest.raises(ValueError, match="one dtype"):
        flatten_into_bucket(
            [torch.zeros(1), torch.zeros(1, dtype=torch.float64)], torch.device("cpu")
        )


def test_build_rank_buckets_frozen_and_empty() -> None:
    trainable = [torch.nn.Parameter(torch.full((2,), float(i))) for i in range(3)]
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    per_rank = [[trainable[0], frozen], [frozen.new_empty(0).requires_grad_(False)], trainable[1:]]
    buckets = build_rank_buckets(params_by_device(per_rank))
    assert len(buckets) == 1
    assert len(buckets[0]) == 3
    rank0, rank1, rank2 = buckets[0]
    assert torch.equal(rank0, torch.zeros(2))
    assert _inside(trainable[0], rank0)
    assert not _inside(frozen, rank0)
    assert torch.equal(rank1, torch.zeros(1))
    assert rank1.dtype == torch.float32
    assert torch.equal(rank2, torch.tensor([1.0, 1.0, 2.0, 2.0]))


def test_rebuilding_after_freezing_detaches_the_frozen_param() -> None:
    params = [torch.nn.Parameter(torch.full((3,), float(i))) for i in range(2)]
    old = build_rank_buckets(params_by_device([params]))[0][0]
    params[0].requires_grad_(False)
    new = build_rank_buckets(params_by_device([params]))[0][0]
    assert torch.equal(new, torch.ones(3))
    old.fill_(7.0)  # the old bucket no longer backs anything
    assert torch.equal(params[0], torch.zeros(3))
    assert torch.equal(params[1], torch.ones(3))


def test_optimizer_steps_through_bucket_views() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    bucket = build_rank_buckets(params_by_device([list(model.parameters())]))[0][0]
    optims = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, reference)]
    x = torch.randn(5, 4)
    for m, opt in zip((model, reference), optims):
        m(x).square().sum().backward()
        opt.step()
    assert torch.equal(bucket, torch.cat([p.detach().reshape(-1) for p in reference.parameters()]))
