"""Showing a Redis URL without its credentials: the one helper every message, log line and
banner that names a URL goes through."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

#: Query parameters redis-py accepts as credentials (``?password=``, ``?ssl_password=``).
_SECRET_PARAMETER = re.compile(r"(^|&)([^=&]*password[^=&]*)=[^&]*", re.IGNORECASE)


def redact(url: str) -> str:
    """``redis://app:s3cret@host:6379/0`` -> ``redis://app:***@host:6379/0`` (and any
    ``password`` query parameter's value -> ``***``). A URL that cannot be parsed is not shown."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a Redis URL that cannot be parsed)"
    # Replaced in place (urlunsplit would turn "unix:///path" into "unix:/path").
    shown = url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        shown = shown.replace(parts.netloc, f"{userinfo.split(':', 1)[0]}:***@{hostport}", 1)
    if parts.query:
        query = _SECRET_PARAMETER.sub(r"\1\2=***", parts.query)
        shown = shown.replace(f"?{parts.query}", f"?{query}", 1)
    return shown
