"""The boundary to Redis: its connections, script calls, the private servers tests start."""
