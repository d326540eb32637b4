"""keyserial on this machine: a private Redis/Valkey server, and an in-process worker for a
block of code (``keyserial dev``, ``keyserial.testing``, the tests and the benchmarks)."""
