"""``keyserial reshard`` and the clients and workers that meet a changed shard count."""
