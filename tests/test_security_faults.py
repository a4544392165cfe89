"""A Redis that answers and refuses us (a wrong password, a certificate it does not trust, a user without a
permission Libra needs), as an operator meets it following README "Securing Redis": every command says why in
one line, at once, instead of waiting it out as an outage, retrying it, or ending in a traceback.

Against ``tests/test_security.py``'s TLS-only redis-server 7 (client certificates required, the README's ACL
user, a user without scripting and a read-only one), with real ``libra-ctl`` processes. Nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pipeline.dataplane.keys import JOBS
from pipeline.dataplane.redisconn import ENV_OUTAGE, ENV_URL, connect

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_security import tls_redis, tls_url  # noqa: F401 (a fixture)
except ModuleNotFoundError:
    from test_security import tls_redis, tls_url  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tls(tls_redis):
    """user, password, ca -> the TLS Redis's URL."""
    _url, port, d = tls_redis
    return lambda **kw: tls_url(port, d, **kw)


def _ctl(url: str, *argv: str, timeout: float, extra_env: dict | None = None) -> tuple[int | None, str, float]:
    """``libra-ctl ARGV`` with ``$LIBRA_REDIS_URL=url``: (exit code, or None past ``timeout``; output; seconds)."""
    env = {**{k: v for k, v in os.environ.items() if k != ENV_URL}, ENV_URL: url, **(extra_env or {})}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return None, out, time.monotonic() - t0


def test_a_controller_with_a_wrong_password_exits_at_once(tls):
    """`libra-ctl controller` (the systemd unit's command) with a wrong password. Before, it took the refusal
    for an outage (redis-py's AuthenticationError is a ConnectionError) and retried for `redis.outage_s`
    (60 s; under `Restart=on-failure`, for ever), logging only `redis_unavailable`; `agent`, `worker` and
    `status` said "refused the credentials" within a second."""
    rc, out, took = _ctl(tls(password="wrong"), "controller", "--interval", "1", "--metrics-port", "0",
                         timeout=25, extra_env={ENV_OUTAGE: "45"})
    assert rc is not None, f"still running after {took:.0f}s with a wrong password:\n{out}"
    assert rc == 1 and "Traceback" not in out and "refused the credentials" in out, out


def test_a_worker_with_a_ca_that_did_not_sign_the_server_says_so(tls):
    """`libra-ctl worker rollout` whose `ssl_ca_certs` is not the server's CA. Before, every failed handshake
    was "not up yet": it waited 120 s and then said "no Redis answered", never naming the certificate."""
    rc, out, took = _ctl(tls(ca="other-ca.pem"), "worker", "rollout", "--job", "secf", timeout=30)
    assert rc is not None, f"still waiting after {took:.0f}s on a certificate error:\n{out}"
    assert rc == 1 and "TLS handshake" in out and "certificate" in out.lower(), out


def test_a_refusal_is_not_retried(tls):
    """No credentials where the server's default user is off. Before, connect()'s retries (meant for a
    connection lost) retried the AuthenticationError: 14.5 s to raise, `libra-ctl status` 18 s; a certificate
    the server requires and is not sent, 16 s."""
    for url, error in ((tls(user=""), redis.AuthenticationError), (tls(ca="other-ca.pem"), redis.ConnectionError)):
        t0 = time.monotonic()
        with pytest.raises(error):
            connect(url).ping()
        assert time.monotonic() - t0 < 5.0, f"{error.__name__} took {time.monotonic() - t0:.1f}s to surface"


@pytest.mark.parametrize("user,argv", [
    ("noscript", ["controller", "--interval", "1", "--metrics-port", "0"]),   # the lease is an EVAL
    ("noscript", ["agent", "--slots", "1", "--node", "secf"]),
    ("ro", ["scale", "--job", "secf", "rollout=1", "reward=1", "learner=1"]),  # a write
])
def test_a_missing_acl_permission_is_one_line(tls, user, argv):
    """A Redis user without a permission Libra needs. Before, a 35-line traceback ending in
    NoPermissionError (and `libra-ctl run` as that user restarted its controller and agent 5 times)."""
    connect(tls()).sadd(JOBS, "secf")   # a job scale knows of
    rc, out, took = _ctl(tls(user=user), *argv, timeout=40)
    assert rc is not None, f"{argv[0]} still running after {took:.0f}s:\n{out}"
    assert rc == 1 and "Traceback" not in out and "lacks a permission" in out, out[-1500:]


def _run(url: str, tmp_path: Path) -> tuple[int | None, str, float]:
    """A one-step `libra-ctl run` of the quick start on ``url``, with a policy not yet prepared."""
    return _ctl(url, "run", "examples/quickstart.toml",
                "--set", f"run.runs_dir={tmp_path / 'runs'}", "--set", f"policy.cache_dir={tmp_path / 'pol'}",
                "--set", "job.steps=1", "--set", "job.eval_size=8", "--set", "job.eval_every=0",
                "--set", "learner.batch_size=64", "--set", "job.name=secf", timeout=45)


def test_run_with_a_wrong_password_fails_before_preparing_the_policy(tls, tmp_path):
    """`libra-ctl run` with a wrong password and a policy not yet prepared. Before, the check made before the
    policy swallowed every Redis error: the refusal came after the policy was built (86 s here; a real
    model's warm start takes far longer), as "Redis unreachable"."""
    rc, out, took = _run(tls(password="wrong"), tmp_path)
    assert rc is not None, f"a wrong password was not reported within {took:.0f}s (the policy is being built):\n{out}"
    assert rc == 1 and "refused the credentials" in out and "preparing the policy" not in out, out


@pytest.mark.parametrize("what", ["password", "ca"])
def test_doctor_names_a_refused_password_or_certificate(tls, what):
    """`libra-ctl doctor` with a wrong password or CA in `$LIBRA_REDIS_URL`. Before, it said "no Redis to
    read; pass --run RUN_DIR for a finished run, or --redis URL": a URL was given, and the cause not said."""
    rc, out, _took = _ctl(tls(password="wrong") if what == "password" else tls(ca="other-ca.pem"), "doctor",
                          timeout=40)
    assert rc == 1, out
    assert ("refused the credentials" if what == "password" else "TLS handshake") in out, out


def test_run_as_a_user_without_scripting_is_refused_before_anything_starts(tls, tmp_path):
    """`libra-ctl run` as an ACL user without EVAL (the controller's lease and the stages' atomic writes are Lua).
    Before, the policy was prepared, then the controller and the agent each exited on their first EVAL and were
    restarted 5 times before the run failed."""
    rc, out, took = _run(tls(user="noscript"), tmp_path)
    assert rc is not None, f"not refused within {took:.0f}s:\n{out}"
    assert rc == 1 and "lacks a permission" in out and "preparing the policy" not in out, out
