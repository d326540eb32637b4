"""Multi-key ops across shards: the home shard's coordinator, a participant's grants, and the
worker's mailbox of grant and decision messages."""
