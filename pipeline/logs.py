"""structlog set-up shared by every process.

Each process writes JSON lines to ``runs/<id>/logs/<name>.jsonl`` and, when
asked, readable lines to stderr. Callers bind job, role, worker id and policy
version so that every line carries them. Every line passes through
``redaction.redact`` (a Redis URL's password becomes ``***``) and the log
files are created 0600.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

import structlog

from pipeline.redaction import open_private, redact_tree


# The first line every start of a process writes to its raw output (``logs/<name>.out``, appended across
# restarts): ``libra-ctl doctor`` reads a worker's output from the last one, so a traceback of an earlier
# life of the worker, which has run since, is not taken for a crash.
OUTPUT_START = "--- libra: output of a new start of this process, at"


def open_output(path: str | Path):
    """A process's raw output file, for its stdout and stderr: appended to, 0600, after a start line."""
    f = open_private(path)
    # on a line of its own, also after an earlier start cut mid-line (a progress bar ends in \r, not \n)
    lead = "\n" if f.tell() > 0 else ""
    f.write(f"{lead}{OUTPUT_START} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} ---\n".encode())
    f.flush()
    return f


def json_safe(o):
    """``o`` with every infinite or NaN float as None: JSON has no such numbers (``Infinity`` breaks jq and
    ``JSON.parse``)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o


def json_line(obj) -> str:
    """One line of JSON that every reader accepts (``json_safe``)."""
    return json.dumps(json_safe(obj), allow_nan=False)


def output_lines(path: str | Path) -> list[str]:
    """The lines of a process's raw output since its latest start line (all of them in a file without one);
    OSError when it cannot be read."""
    text = Path(path).read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(text) if OUTPUT_START in line]
    return text[starts[-1] + 1 if starts else 0:]


def output_tail(path: str | Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a process's raw output since its latest start (what a failure message
    quotes), or "(no output)"."""
    try:
        return "\n".join(output_lines(path)[-lines:]) or "(no output)"
    except OSError:
        return "(no output)"


def configure(log_dir: Path | None, name: str, *, console: bool = True, level: int = logging.INFO):
    """Route structlog to a JSON file (and the console); returns a bound logger."""
    handlers: list[logging.Handler] = []
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / f"{name}.jsonl"
        open_private(path).close()   # FileHandler appends to it and keeps the mode
        fh = logging.FileHandler(path)
        fh.setFormatter(structlog.stdlib.ProcessorFormatter(
            processor=structlog.processors.JSONRenderer(),
            foreign_pre_chain=_pre_chain()))
        handlers.append(fh)
    if console:
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(structlog.stdlib.ProcessorFormatter(
            processor=structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
            foreign_pre_chain=_pre_chain()))
        handlers.append(ch)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(
        processors=_pre_chain() + [structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger(name)


def _pre_chain():
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        _redact_secrets,
    ]


class _Current:
    """``sys.stdout`` or ``sys.stderr`` as it is when written to, for a default argument: bound at import, the
    stream itself may be one a test harness (or a redirection) has closed since."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        return getattr(getattr(sys, self.name), attr)


STDOUT, STDERR = _Current("stdout"), _Current("stderr")


def _redact_secrets(_logger, _method, event_dict: dict) -> dict:
    """No password of a URL reaches a log line, whatever a caller (or a library) put in it (an exception or
    bytes are written as their redacted text)."""
    return {k: v if k in _META else redact_tree(v) for k, v in event_dict.items()}


_META = ("_record", "_from_structlog")   # what ProcessorFormatter adds for a library's log record: its own
