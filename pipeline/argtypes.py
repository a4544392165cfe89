"""argparse types for the command line's numbers: a bad value is a usage error (exit 2) naming the rule.

``float("nan")`` and ``float("inf")`` parse as floats, and a negative count
parses as an int; each would reach the code as a crash, a loop that never
sleeps, or a wait that never ends. These types refuse them where argparse
reads the flag.
"""

from __future__ import annotations

import argparse
import math


def number(kind: type, low: float, strict: bool = False):
    """A ``kind`` (int or float) number, finite, of at least ``low`` (above it when ``strict``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not math.isfinite(value) or value < low or strict and value == low:
            raise argparse.ArgumentTypeError(f"{text}: must be {'above' if strict else 'at least'} {low:g}")
        return value
    parse.__name__ = kind.__name__   # argparse names the type in its messages
    return parse


count = number(int, 1)                        # how many of something: 1 or more
whole = number(int, 0)                        # 0 or more (a seed, a count that may be none)
seconds = number(float, 0, strict=True)       # a duration or an interval: above 0
seconds_or_none = number(float, 0)            # a wait that may be 0 (do not wait)


def port(text: str) -> int:
    """A TCP port: 0 to 65535 (0: none, or any free one, as the flag says)."""
    value = whole(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text}: a port is 0 to 65535")
    return value


def unwritable(flag: str, path: str | None, *, directory: bool = False) -> str | None:
    """Why ``path`` (given as ``flag``) cannot take an output written after minutes of work, or None: a file in
    a missing or read-only directory, or a ``directory`` that is a file or cannot be made. Checked up front."""
    if path is None:
        return None
    import os
    from pathlib import Path

    p = Path(path).resolve()
    if directory:
        if p.exists() and not p.is_dir():
            return f"{flag} {path}: a file is there, not a directory"
        nearest = next(d for d in (p, *p.parents) if d.exists())
        return None if nearest.is_dir() and os.access(nearest, os.W_OK) else \
            f"{flag} {path}: {nearest} cannot be written"
    if p.is_dir():
        return f"{flag} {path}: a directory; give a file name"
    if p.exists():   # a file to replace, or a device such as /dev/null
        return None if os.access(p, os.W_OK) else f"{flag} {path}: cannot be written"
    if p.parent.exists() and not p.parent.is_dir():   # `afile/out.json`: the write would fail after the work
        return f"{flag} {path}: {p.parent} is a file, not a directory"
    return None if os.access(p.parent, os.W_OK) else f"{flag} {path}: its directory does not exist or cannot be written"
