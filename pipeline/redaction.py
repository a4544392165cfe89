"""Secrets out of sight: the one redaction of Redis URLs, and files only their owner can read.

Every place that shows or stores a URL (logs, ``manifest.json``, ``redis.url``,
``status``, messages printed by the CLI) passes it through ``redact``: the
password of ``scheme://user:password@host`` and the values of ``password`` /
``ssl_password`` query parameters become ``***``. A process that needs the
real URL gets it in ``$LIBRA_REDIS_URL``, never on its command line (``ps``
shows argv to every user of the machine) nor in a file other than a 0600 one.

It sits in the common plane (beside ``logs`` and ``manifest``, which use it)
so that every process can import it; ``write_private`` and ``open_private``
create run files with mode 0600 from the start (no window in which another
user can open them).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

MASK = "***"

# scheme://[user]:password@ : the password runs to the last '@' before the host part, whatever it holds
# ('/', '?', '#' and '@' too: a password pasted unencoded, which redis-py parses apart and may echo)
_USERINFO = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@\s]*:)(?P<secret>[^\s\"'<>]*)(?P<at>@)")
# ?password=...&ssl_password=... (redis-py passes unknown query parameters on to the connection)
_QUERY = re.compile(r"(?P<head>[?&](?:password|ssl_password)=)(?P<secret>[^&#\s\"']*)", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (other text unchanged)."""
    if "://" not in text and "password=" not in text.lower():
        return text
    text = _USERINFO.sub(lambda m: m["head"] + (MASK if m["secret"] else "") + m["at"], text)
    return _QUERY.sub(lambda m: m["head"] + MASK, text)


def redact_tree(obj: Any) -> Any:
    """A copy of a JSON-like value with every string in it redacted (dict keys included); anything else
    but a number (an exception, bytes, a path) becomes its redacted text."""
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_tree(k): redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_tree(v) for v in obj]
    if isinstance(obj, bytes):
        return redact(obj.decode(errors="replace"))
    return redact(repr(obj) if isinstance(obj, BaseException) else str(obj))


def is_redacted(url: str) -> bool:
    """Whether ``url`` lost its password to ``redact`` (it cannot be used to connect)."""
    return MASK in url and redact(url) == url


def open_private(path: str | Path, mode: str = "ab"):
    """``open(path, mode)`` for a file created 0600 (an existing file is narrowed to 0600)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)   # a file left by an older version, or created under another umask
    return os.fdopen(fd, mode)


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path``, readable and writable by its owner only."""
    with open_private(path, "w") as f:
        f.write(text)
