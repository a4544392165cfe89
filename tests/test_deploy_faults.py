"""Secrets and the Redis of a deployment under inputs that used to leak or break them.

A password in a config error, in ``libra-ctl config``, in a URL redis-py
cannot parse, in the Slurm job's log line; an embedded server under a path
with a space; two ``libra-ctl redis`` on one directory; a socket URL with a
query.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect, find_redis_url

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "deploy" / "slurm" / "libra.sbatch"
SECRET = "S3cretPW"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    env.update(extra)
    return env


def _libra_ctl(args: list[str], timeout: float = 60, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


# --- passwords in messages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, code", [("tcp", 2), ("redis", 0)])
def test_libra_ctl_config_never_prints_the_redis_password(tmp_path, capsys, scheme, code):
    """``libra-ctl config JOB.toml`` shows redis.url's password as ``***``: in the resolved config it prints
    (``redis://``), and in the error refusing a wrong scheme (``tcp://``, exit 2)."""
    job = tmp_path / "job.toml"
    job.write_text(f'[redis]\nurl = "{scheme}://:{SECRET}@h:6379/0"\n')
    assert cli.main(["config", str(job)]) == code
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err, out.out + out.err


def test_malformed_password_url_gives_an_error_not_a_traceback_with_the_password():
    """A password pasted into LIBRA_REDIS_URL with an unencoded '/' (``openssl rand -base64``): a message saying
    to percent-encode it, exit 2, no traceback and no part of the password (redis-py's parse error quoted
    the part before the '/')."""
    url = "redis://:Xy9/Qz+wT@127.0.0.1:1/0"
    res = _libra_ctl(["redis", "--wait", "--timeout", "0"], **{ENV_URL: url})
    assert res.returncode == 2 and "percent-encode" in res.stderr, res.stderr[-400:]
    assert "Traceback" not in res.stderr, res.stderr[-400:]
    assert "Xy9" not in res.stdout + res.stderr, res.stderr[-400:]


def test_libra_ctl_redis_using_a_url_does_not_print_its_password():
    """``libra-ctl redis`` with LIBRA_REDIS_URL set says which Redis it uses: a password with an unencoded '/'
    is hidden too (the pattern used to stop at '/')."""
    url = "redis://:Xy9/Qz+wT@127.0.0.1:6390/0"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "redis"], cwd=ROOT, env=_env(**{ENV_URL: url}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert line.startswith("redis: using"), line
    assert "Xy9" not in line and "Qz+wT" not in line, line


def test_sbatch_redis_line_does_not_print_the_password():
    """The Slurm job's line naming its Redis shows no part of a password holding '@' (redis-py takes the host
    after the last '@') nor of a ``?password=`` (``${LIBRA_REDIS_URL#*@}`` printed both)."""
    (line,) = [ln.strip() for ln in SBATCH.read_text().splitlines() if "libra: redis at" in ln]
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"   # the job puts the checkout's .venv/bin first
    for url, secret in [("redis://:p@ss-word@redis.internal:6379/0", "ss-word"),
                        ("redis://redis.internal:6379/0?password=S3cretPW", SECRET)]:
        res = subprocess.run(["bash", "-c", line], env={"PATH": path, ENV_URL: url}, cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert "redis.internal" in res.stdout and secret not in res.stdout, f"{url}: {res.stdout!r}"


# --- the embedded server ------------------------------------------------------------------------------------


def test_embedded_redis_starts_in_a_directory_with_a_space(tmp_path):
    """A run directory under a path with a space (a checkout in "~/My Projects") gets its embedded Redis
    (redis.conf held the paths unquoted: "wrong number of arguments")."""
    server = EmbeddedRedis(tmp_path / "my runs" / "redis")
    try:
        server.start(timeout_s=10)
        assert connect(server.url).ping()
    finally:
        server.stop()


def test_second_libra_ctl_redis_on_the_same_dir_exits_cleanly(tmp_path):
    """Two ``libra-ctl redis --dir D`` started together: the second exits 1 with a message, no traceback (the
    test holds the lock as the first server does while it starts)."""
    data = tmp_path / "shared"
    data.mkdir()
    fd = os.open(data / "redis.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        res = _libra_ctl(["redis", "--dir", str(data)], timeout=90)
    finally:
        os.close(fd)
    assert res.returncode == 1 and "is still running" in res.stderr, res.stderr[-600:]
    assert "Traceback" not in res.stderr, res.stderr[-600:]


def test_find_redis_url_finds_a_live_unix_socket_with_a_query(redis_url, tmp_path, monkeypatch):
    """A run's ``redis.url`` of ``unix:///path/redis.sock?db=0`` is found while its server answers (the query
    was taken as part of the socket's path, and the run skipped as gone)."""
    if not redis_url.startswith("unix://") or "?" in redis_url:
        pytest.skip("needs the suite's embedded server on a unix socket")
    url = redis_url + "?db=0"
    assert connect(url).ping()
    run = tmp_path / "runs" / "20260101-000000-job"
    run.mkdir(parents=True)
    (run / "redis.url").write_text(url + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_URL, raising=False)
    assert find_redis_url(None) == url


def test_redis_wait_on_a_server_that_refuses_the_password_says_so_at_once(tmp_path):
    """``libra-ctl redis --wait`` against a server that is up and refuses the URL's password exits 1 saying
    the credentials were refused, without a traceback, instead of waiting out ``--timeout`` as if the
    server were not up yet ("no Redis answered")."""
    from pipeline.dataplane.redisconn import redis_server_binary

    sock = tmp_path / "r.sock"
    server = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", str(sock), "--save", "",
                               "--appendonly", "no", "--requirepass", "right"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        res = _libra_ctl(["redis", "--wait", "--timeout", "60"], timeout=120,
                         **{ENV_URL: f"unix://:wrong@{sock}"})
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert res.returncode == 1 and "refused the credentials" in res.stderr, res.stderr[-600:]
    assert "Traceback" not in res.stderr and "wrong" not in res.stderr, res.stderr[-600:]


def test_a_manifest_outside_a_checkout_records_the_commit_the_build_gave(monkeypatch):
    """In the image (no ``.git``, no git binary) the manifest's commit is the build's ``LIBRA_GIT_COMMIT``,
    not None; the Dockerfile passes it on as the build argument it documents."""
    from pipeline import manifest

    def no_git(*_a, **_k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(manifest.subprocess, "run", no_git)
    monkeypatch.setenv("LIBRA_GIT_COMMIT", "0123abc")
    assert manifest.git_commit() == "0123abc"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG LIBRA_GIT_COMMIT" in dockerfile and "ENV LIBRA_GIT_COMMIT=$LIBRA_GIT_COMMIT" in dockerfile
