"""Multi-key and cross-shard ops: atomicity, grant requests, races and faults, zombie writes."""
