"""What crosses Redis, as bytes and names, with no I/O: the key and channel layout, the wire
format's codec (envelopes, entries, outcomes, replies), the cross-shard messages, routing of
keys to shards, the one JSON encoding, the signing of replies, and the records a worker or an
operator keeps (the roster, a reshard's, pauses, dead letters)."""
