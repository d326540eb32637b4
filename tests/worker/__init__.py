"""The worker: leases, steps, order, threads, caches, fences, its pipeliner, metrics and logs."""
