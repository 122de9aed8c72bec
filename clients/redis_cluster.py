"""What differs when Conveyor talks to a Redis/Valkey Cluster (`--redis-cluster`).

redis-py's cluster clients (`redis.cluster.RedisCluster`, `redis.asyncio.cluster.RedisCluster`)
route each command by its key's hash slot. Conveyor's key layout (clients/keys.py) keeps
every script and MULTI inside one slot; what is left is here: cluster pipelines refuse
EVALSHA, so a script queued on one is sent as EVAL with its text (any node runs it, also a
replica just promoted that never loaded the script), and which errors mean "the cluster is
failing over: try again".
"""

from __future__ import annotations

from typing import Any, Sequence

import redis.asyncio.cluster as async_cluster
import redis.cluster as sync_cluster
from redis.exceptions import ClusterDownError, MasterDownError, SlotNotCoveredError, TryAgainError

CLUSTER_CLIENTS = (sync_cluster.RedisCluster, async_cluster.RedisCluster)
CLUSTER_PIPELINES = (sync_cluster.ClusterPipeline, async_cluster.ClusterPipeline)
# a slot without a master for a moment (failover under way): retried like a lost connection
FAILOVER_ERRORS = (ClusterDownError, MasterDownError, SlotNotCoveredError, TryAgainError)


def is_cluster(client: Any) -> bool:
    return isinstance(client, CLUSTER_CLIENTS) or isinstance(client, CLUSTER_PIPELINES)


def queue_script_sync(script: Any, keys: Sequence, args: Sequence, pipe: Any) -> None:
    """Queue a registered script on a sync pipeline (plain or cluster)."""
    if isinstance(pipe, sync_cluster.ClusterPipeline):
        pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
    else:
        script(keys, args, client=pipe)


async def queue_script(script: Any, keys: Sequence, args: Sequence, pipe: Any) -> None:
    """Queue a registered script on an asyncio pipeline (plain or cluster)."""
    if isinstance(pipe, async_cluster.ClusterPipeline):
        pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
    else:
        await script(keys=list(keys), args=list(args), client=pipe)  # loads the script if needed
