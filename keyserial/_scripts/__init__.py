"""keyserial's Lua scripts (``lua/``) as typed calls, and the refusals they answer with. Calls
are data: the Redis boundary sends them."""
