"""torch.distributed runtime: process groups, partitioning, flat buckets, averaging, RPC.

Planning is kept apart from communication: :mod:`~dist_runtime.partition` and
:mod:`~dist_runtime.flat_partition` are pure functions (sizes in, ranks out); the modules that
talk to torch.distributed wrap its collectives, RPC and checkpointing behind small typed helpers.
"""

from dist_runtime import (
    averaging,
    backward_step,
    backward_step_wrappers,
    buckets,
    collective_failure,
    compression,
    cost_partition,
    ddp_bucket_plan,
    flat_grad_exchange,
    flat_partition,
    flat_shards,
    fragment_plan,
    hierarchy,
    outer_sync,
    param_sync,
    partition,
    piece_state,
    process_group,
    pseudo_gradient,
    rpc_optim,
    safe_load,
    sharded_checkpoint,
    state_consolidation,
    step_rollback,
    streaming_consolidation,
)
from dist_runtime.averaging import FlatParameterCache, average_parameters, params_to_average
from dist_runtime.backward_step import OptimizerInBackward, optimizer_in_backward
from dist_runtime.collective_failure import CollectiveFailedError, collective_guard
from dist_runtime.cost_partition import balanced_cost_partition, cost_balanced_planner
from dist_runtime.flat_partition import FlatLayout, plan_flat_layout
from dist_runtime.flat_shards import FlatShards, clip_grads_by_global_norm
from dist_runtime.hierarchy import build_period_groups, check_hierarchy, select_period
from dist_runtime.param_sync import ShardBroadcaster
from dist_runtime.partition import sorted_greedy_partition
from dist_runtime.process_group import (
    all_gather_objects,
    broadcast_object,
    global_rank,
    group_rank,
    group_size,
    require_initialized,
    resolve_group,
)
from dist_runtime.rpc_optim import create_remote_optimizers, step_remote_optimizers
from dist_runtime.safe_load import UnsafeCheckpointError
from dist_runtime.sharded_checkpoint import (
    latest_checkpoint,
    load_optimizer_shards,
    save_optimizer_shards,
)
from dist_runtime.step_rollback import OptimizerSnapshot, rollback_on_failure

__all__ = [
    "CollectiveFailedError",
    "FlatLayout",
    "FlatParameterCache",
    "FlatShards",
    "OptimizerInBackward",
    "OptimizerSnapshot",
    "ShardBroadcaster",
    "UnsafeCheckpointError",
    "all_gather_objects",
    "average_parameters",
    "averaging",
    "backward_step",
    "backward_step_wrappers",
    "balanced_cost_partition",
    "broadcast_object",
    "buckets",
    "build_period_groups",
    "check_hierarchy",
    "clip_grads_by_global_norm",
    "collective_failure",
    "collective_guard",
    "compression",
    "cost_balanced_planner",
    "cost_partition",
    "create_remote_optimizers",
    "ddp_bucket_plan",
    "flat_grad_exchange",
    "flat_partition",
    "flat_shards",
    "fragment_plan",
    "global_rank",
    "group_rank",
    "group_size",
    "hierarchy",
    "latest_checkpoint",
    "load_optimizer_shards",
    "optimizer_in_backward",
    "outer_sync",
    "param_sync",
    "params_to_average",
    "partition",
    "piece_state",
    "plan_flat_layout",
    "process_group",
    "pseudo_gradient",
    "require_initialized",
    "resolve_group",
    "rollback_on_failure",
    "rpc_optim",
    "safe_load",
    "save_optimizer_shards",
    "select_period",
    "sharded_checkpoint",
    "sorted_greedy_partition",
    "state_consolidation",
    "step_remote_optimizers",
    "step_rollback",
    "streaming_consolidation",
]
