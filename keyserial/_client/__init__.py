"""The client: ``connect``, submit ops, read state and outcomes; appends coalesced per node,
outcomes from signed replies or the shards' records, the sweep of overdue ones, and the
wrappers for threads and other event loops."""
