"""Faults with real processes and servers: kill -9, SIGSTOP, restarts, failovers, the nemesis."""
