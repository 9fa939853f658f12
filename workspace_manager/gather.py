"""The quantized FSDP2 all-gather of high-precision parameters, for bindings.

Where a plan makes an FSDP2 weight's workspace from the shard
(``WorkspaceOrigin.SHARD``, docs/decisions.md, D13), a binding sets this
mechanism up for the weight: each rank quantizes its shard once per
optimizer step and FSDP2 gathers the quantized bytes. The binding supplies
how its framework quantizes a shard (a :class:`ShardQuantizer`) and builds
the gathered weight its modules compute with (a
:class:`GatheredWeightFactory`); ``workspace_manager._shard_gather``'s
docstring says how the rest works. This module imports torch (the package's
top level does not): import it where the gather is set up.
"""

from ._shard_gather import (
    BatchShardQuantizer,
    GatherContext,
    GatherCounts,
    GatheredWeightFactory,
    GatherPass,
    QuantizedShard,
    ShardGatherState,
    ShardGatherWeight,
    ShardLayout,
    ShardQuantizer,
    enable_quantized_gather,
    enable_quantized_gather_sharded,
    plain_tensor,
)

__all__ = [
    # what a binding supplies
    "ShardQuantizer",
    "BatchShardQuantizer",
    "GatheredWeightFactory",
    "ShardLayout",
    "GatherContext",
    "GatherPass",
    # setting it up, and the state of one model's quantized shards
    "enable_quantized_gather",
    "enable_quantized_gather_sharded",
    "ShardGatherState",
    "GatherCounts",
    "QuantizedShard",
    # the wrapper of a sharded parameter's local tensor
    "ShardGatherWeight",
    "plain_tensor",
]
