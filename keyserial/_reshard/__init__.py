"""Resharding: moving a live namespace to another shard count (see ``mover``)."""
