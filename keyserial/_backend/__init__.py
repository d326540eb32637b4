"""The Redis boundary, the only package that imports redis: connections (its own pipelined
one, or redis-py's), error classification, subscriptions, keyserial's commands in its own
terms, and confirming writes on replicas."""
