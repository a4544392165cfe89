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
