"""``keyserial dashboard``: a web view of one namespace (shards, workers, dead letters, keys),
with the operator's actions (replay, drop, pause) behind a token."""
