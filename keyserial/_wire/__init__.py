"""What crosses Redis, as bytes and names, with no I/O: the key and channel layout, the wire
format's codec (envelopes, entries, outcomes, replies), the cross-shard messages, routing of
keys to shards, the one JSON encoding, and the signing of replies."""
