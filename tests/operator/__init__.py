"""The operator's tools: the command line, status, keys, dead letters, the dashboard, traces."""
