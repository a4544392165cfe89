"""The suite never touches data it did not create: no $LIBRA_REDIS_URL, and no flush of a database not its own."""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.dataplane.keys import JOBS
from pipeline.dataplane.redisconn import ENV_URL, connect

try:
    from tests.conftest import OWNER_KEY, SESSION_SIGINT, claim, clean
except ImportError:   # tests/ on sys.path instead of the repository root
    from conftest import OWNER_KEY, SESSION_SIGINT, claim, clean


def test_no_test_or_process_it_starts_sees_the_production_redis_url():
    # deploy/libra.env exports LIBRA_REDIS_URL on production nodes; conftest removes it for the whole session
    assert ENV_URL not in os.environ


def test_a_database_holding_libra_jobs_is_refused_and_left_as_it_was(redis_url):
    other = connect(redis_url, db=7)          # a database of the same server that the suite has not claimed
    other.flushdb()
    other.sadd(JOBS, "prod-job")
    other.set("libra:job:prod-job:state", "running")
    with pytest.raises(pytest.exit.Exception, match="holds Libra jobs prod-job"):
        clean(other, redis_url)
    assert other.smembers(JOBS) == {b"prod-job"} and other.get(OWNER_KEY) is None   # nothing flushed
    other.delete(JOBS)
    with pytest.raises(pytest.exit.Exception, match="holds 1 keys"):    # anything at all, not only jobs
        claim(other, redis_url)
    other.flushdb()
    clean(other, redis_url)                   # empty: claimed, then cleaned at will
    other.set("x", 1)
    clean(other, redis_url)
    assert other.dbsize() == 1 and other.get(OWNER_KEY) is not None
    other.flushdb()


def test_a_test_that_takes_over_ctrl_c_here_one():
    # as code run in this process may (cli and agent entry points install their own): the next test checks
    # that the conftest fixture undid it (scripts/test's --dist loadfile runs a module on one worker, in order)
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)


def test_the_next_test_has_pytests_ctrl_c_back():
    assert signal.getsignal(signal.SIGINT) is SESSION_SIGINT
