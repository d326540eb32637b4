"""The client: submits, enqueues, the sync client, replies (lost, refused, pushed) and its
connections' health."""
