"""The worker: shard leases, one runner per owned shard (fetch, run, group-commit), what an
entry asks of its shard, the per-key chains, the commit planner, the pipeliner of script calls,
metrics, and multi-key ops across shards (``crossshard``)."""
