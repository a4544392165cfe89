"""Security: control actions from an allowlist, Redis ACL + TLS, no secret in a run's files, local listeners.

Every test runs real parts: the session's Redis (or one started here with TLS
and an ACL user, certificates made by ``trustme``), the node agent's rq job
runner, ``libra-ctl controller`` / ``agent`` / ``redis`` processes and sim
workers. Nothing is mocked.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from rq import Callback, Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from pipeline import logs, manifest as manifest_mod
from pipeline.config import from_dict
from pipeline.control import actions
from pipeline.control.agent import Agent, Slot
from pipeline.control.local import start_local_control
from pipeline.dataplane.keys import AGENTS, JobKeys, agent_desired, agent_procs, agent_queue
from pipeline.dataplane.redisconn import ENV_URL, EmbeddedRedis, connect, find_redis_url
from pipeline.dataplane.worker import load_run_config
from pipeline.observe.audit import audit
from pipeline.observe.metrics import start_sampler
from pipeline.redaction import MASK, is_redacted, redact
from pipeline.run import _choose_redis, _start_redis

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_sim_workers import sim_job, wait_for
except ModuleNotFoundError:
    from test_sim_workers import sim_job, wait_for

ROOT = Path(__file__).resolve().parent.parent
NODE = "sec1"
JOB = "simtest"
PASSWORD = "pw-Zq7$x9-never-in-a-file"   # '$' is quoted in the URL (%24): both spellings are searched


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def secret_hits(data: bytes) -> bool:
    return PASSWORD.encode() in data or quote(PASSWORD, safe="").encode() in data


# --- redaction ----------------------------------------------------------------------------------------------


def test_redact_hides_every_password_and_keeps_the_rest():
    url = f"rediss://libra:{quote(PASSWORD, safe='')}@10.0.0.5:6380/0?ssl_ca_certs=/c/ca.pem&ssl_cert_reqs=required"
    assert redact(url) == "rediss://libra:***@10.0.0.5:6380/0?ssl_ca_certs=/c/ca.pem&ssl_cert_reqs=required"
    assert redact("redis://:p@ss@h:1") == "redis://:***@h:1"                        # default user, '@' inside
    assert redact("redis://h:1/0?db=1&password=x&ssl_password=y") == "redis://h:1/0?db=1&password=***&ssl_password=***"
    line = 'libra-ctl run q.toml --set redis.url="redis://u:secret@h:6379"'
    assert redact(line) == 'libra-ctl run q.toml --set redis.url="redis://u:***@h:6379"'
    for clean in ("unix:///tmp/r.sock", "redis://user@h:1/0", "http://127.0.0.1:9464/metrics", "no url here"):
        assert redact(clean) == clean and not is_redacted(clean)
    assert is_redacted(redact(url)) and not is_redacted(url)


def test_run_files_hold_no_password_and_are_private(tmp_path, monkeypatch):
    """manifest.json, redis.url and the JSON logs of a run whose Redis URL has a password."""
    url = f"redis://libra:{quote(PASSWORD, safe='')}@127.0.0.1:6390/0"
    cfg = from_dict({"redis": {"url": url}, "run": {"runs_dir": str(tmp_path / "runs")}})
    run_dir = manifest_mod.new_run_dir(cfg)
    written = manifest_mod.write_manifest(run_dir, cfg, argv=["libra-ctl", "run", "--set", f"redis.url={url}"],
                                          redis_url=url, embedded=False, policy_dir="", bad_prompt_lines=[])
    _start_redis(None, url, run_dir, io.StringIO())
    log = logs.configure(run_dir / "logs", "probe", console=False)
    log.info("connected", url=url, nested={"argv": ["--redis", url]})
    log.warning(f"retrying {url}")
    for h in __import__("logging").getLogger().handlers:
        h.flush()
    files = [run_dir / "manifest.json", run_dir / "redis.url", run_dir / "logs" / "probe.jsonl"]
    for f in files:
        assert not secret_hits(f.read_bytes()), f
        assert mode(f) == 0o600, f
    assert MASK in (run_dir / "logs" / "probe.jsonl").read_text()
    assert written["redis"]["url"] == redact(url) and written["config"]["redis"]["url"] == redact(url)
    # a command that finds the run's Redis by its redis.url says where the password must come from
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_URL, raising=False)
    with pytest.raises(SystemExit, match=ENV_URL):
        find_redis_url(None)
    # resume: the manifest's redacted URL gives way to the full one in the environment
    resumed = from_dict(json.loads((run_dir / "manifest.json").read_text())["config"])
    monkeypatch.setenv(ENV_URL, url)
    assert _choose_redis(resumed, run_dir, run_dir) == (url, None)


# --- the agent runs only control actions ---------------------------------------------------------------------


EVIL_MODULE = "libra_evil_import_probe"


@pytest.fixture
def agent(r, redis_url):
    a = Agent(r, redis_url, NODE, [Slot(0, None), Slot(1, None)], grace_s=5.0).start()
    yield a
    a.shutdown(timeout_s=5)


def test_agent_refuses_every_job_that_is_not_a_control_action(r, agent, tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    (tmp_path / f"{EVIL_MODULE}.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').write('x')\n"
        f"def run(path):\n    open(path, 'w').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    q = Queue(agent_queue(NODE), connection=r, serializer=JSONSerializer)
    pickled = Queue(agent_queue(NODE), connection=r)   # rq's default serializer: pickle
    spec = {"job": JOB, "worker": "rollout-sec1-0", "role": "rollout", "slots": [0], "run_dir": str(tmp_path),
            "backend": "sim"}
    hostile = {
        "os.system": q.enqueue("os.system", f"touch {marker}", retry=Retry(max=3)),
        "subprocess.call": q.enqueue("subprocess.call", ["touch", str(marker)]),
        "an import side effect": q.enqueue(f"{EVIL_MODULE}.run", str(marker)),
        "a pickled job": pickled.enqueue("os.system", f"touch {marker}"),
        "a callback": q.enqueue(actions.drain_worker, NODE, JOB, "w", 10**9, 0,
                                on_success=Callback("os.system"), on_failure=Callback("os.system")),
        "a role outside the table": q.enqueue(actions.ensure_worker, NODE, {**spec, "role": "bash"}, 10**9, 0),
        "an extra spec field": q.enqueue(actions.ensure_worker, NODE, {**spec, "argv": ["sh"]}, 10**9, 0),
        "a path as worker id": q.enqueue(actions.drain_worker, NODE, JOB, "../../etc/x", 10**9, 0),
        "another node": q.enqueue(actions.drain_worker, "elsewhere", JOB, "w", 10**9, 0),
        "keyword arguments": q.enqueue(actions.drain_worker, NODE, JOB, "w", 10**9, epoch=0),
        "a bool as seq": q.enqueue(actions.drain_worker, NODE, JOB, "w", True, 0),
    }
    unhashable = q.enqueue("os.system", "true")
    r.hset(unhashable.key, "data", json.dumps([["os", "system"], None, ["true"], {}]))
    hostile["a list as function"] = unhashable
    # a job hash rq cannot even load: dropped and logged, and the agent goes on
    r.hset("rq:job:unreadable", mapping={"data": "{}", "created_at": "not-a-date"})
    r.rpush(q.key, "unreadable")
    legit = [actions.ensure(r, NODE, spec), actions.drain(r, NODE, JOB, "feeder-9")]
    wanted = [*hostile.values(), *legit]
    wait_for(lambda: agent.step() or all(Job.fetch(j.id, connection=r).get_status() in ("finished", "failed")
                                         for j in wanted), 30, "the agent to handle every job")
    time.sleep(2.5)   # past the first retry interval: a refused job is never tried again
    agent.step()
    for what, j in hostile.items():
        j = Job.fetch(j.id, connection=r, serializer=JSONSerializer)
        assert j.get_status() == "failed", what
        assert "refused by the agent" in (j.latest_result().exc_string or ""), what
    assert not marker.exists() and not (tmp_path / "imported").exists()
    assert not r.lrange(q.key, 0, -1)   # the unreadable job too was taken off the queue, and the agent went on
    assert EVIL_MODULE not in sys.modules
    assert [Job.fetch(j.id, connection=r).get_status() for j in legit] == ["finished", "finished"]
    desired = {k.decode(): json.loads(v) for k, v in r.hgetall(agent_desired(NODE)).items()}
    assert desired[f"{JOB}/rollout-sec1-0"]["state"] == "run" and desired[f"{JOB}/feeder-9"]["state"] == "gone"
    assert set(desired) == {f"{JOB}/rollout-sec1-0", f"{JOB}/feeder-9"}


# --- listeners -------------------------------------------------------------------------------------------------


def listening(port: int) -> set[str]:
    """The IPv4/IPv6 addresses with a socket listening on ``port`` (from /proc/net/tcp*)."""
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:      # 0A: LISTEN
                found.add(str(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1])) if len(addr) == 8
                          else addr)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def controller_listens_on(redis_url: str, tmp_path: Path, *extra: str) -> set[str]:
    port = free_port()
    out = open(tmp_path / f"controller-{port}.out", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "controller", "--interval", "1",
                             "--metrics-port", str(port), *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **{ENV_URL: redis_url}))
    try:
        return wait_for(lambda: listening(port), 60, f"the controller's /metrics on port {port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_metrics_listen_on_loopback_unless_told_otherwise(redis_url, tmp_path):
    assert controller_listens_on(redis_url, tmp_path) == {"127.0.0.1"}
    assert controller_listens_on(redis_url, tmp_path, "--metrics-host", "0.0.0.0") == {"0.0.0.0"}


def check_local_only(url: str, conf_dir: Path) -> None:
    c = connect(url)
    cfg = {k: c.config_get(k)[k] for k in ("port", "bind", "protected-mode", "unixsocketperm")}
    assert cfg == {"port": "0", "bind": "127.0.0.1", "protected-mode": "yes", "unixsocketperm": "700"}, cfg
    sock = Path(url[len("unix://"):])
    assert stat.S_ISSOCK(sock.stat().st_mode) and mode(sock) == 0o700
    assert mode(conf_dir / "redis.conf") == 0o600


def test_embedded_redis_listens_on_its_socket_only(tmp_path):
    with EmbeddedRedis(tmp_path / "embedded") as server:
        check_local_only(server.url, tmp_path / "embedded")
    data = tmp_path / "shared"
    env = {k: v for k, v in os.environ.items() if k != ENV_URL}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "redis", "--dir", str(data)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (data / "redis.url").exists() and (data / "redis.url").read_text().strip(), 30,
                 "libra-ctl redis to write redis.url")
        assert mode(data / "redis.url") == 0o600
        check_local_only((data / "redis.url").read_text().strip(), data)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


# --- a whole job over TLS with an ACL user ------------------------------------------------------------------------


@pytest.fixture
def tls_redis(tmp_path):
    """redis-server 7 with TLS only (client certificates required) and one ACL user; yields the client URL."""
    trustme = pytest.importorskip("trustme")
    binary = shutil.which("redis-server", path="/usr/bin:/usr/local/bin") or shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server 7 on this machine")
    tls = tmp_path / "tls"
    tls.mkdir()
    ca, other = trustme.CA(), trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("libra-client.example")
    ca.cert_pem.write_to_path(str(tls / "ca.pem"))
    other.cert_pem.write_to_path(str(tls / "other-ca.pem"))   # a CA that did not sign the server's certificate
    server.private_key_pem.write_to_path(str(tls / "server.key"))
    server.cert_chain_pems[0].write_to_path(str(tls / "server.pem"))
    client.private_key_pem.write_to_path(str(tls / "client.key"))
    client.cert_chain_pems[0].write_to_path(str(tls / "client.pem"))
    port = free_port()
    conf = tls / "redis.conf"
    conf.write_text("\n".join([
        "port 0", f"tls-port {port}", "bind 127.0.0.1", f"dir {tls}", "save \"\"", "appendonly no",
        f"tls-cert-file {tls / 'server.pem'}", f"tls-key-file {tls / 'server.key'}",
        f"tls-ca-cert-file {tls / 'ca.pem'}", "tls-auth-clients yes",
        "user default off", f"user libra on >{PASSWORD} ~* &* +@all -@admin",   # the README's ACL
        f"user noscript on >{PASSWORD} ~* &* +@all -@admin -@scripting",      # no EVAL
        f"user ro on >{PASSWORD} ~* &* +@read +@connection",                  # read-only
    ]) + "\n")
    os.chmod(conf, 0o600)
    proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = tls_url(port, tls)
    try:
        wait_for(lambda: proc.poll() is not None or _answers(url), 30, "the TLS Redis")
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace")
            if "TLS" in out and "not" in out and os.environ.get("CI") != "true":
                pytest.skip(f"{binary} is built without TLS")
            pytest.fail(f"the TLS Redis exited: {out}")
        yield url, port, tls
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def tls_url(port: int, tls: Path, user: str = "libra", password: str = PASSWORD, ca: str = "ca.pem") -> str:
    """The URL of ``tls_redis`` for ``user`` (none: no credentials), with the client certificate and ``ca``."""
    query = (f"ssl_ca_certs={tls / ca}&ssl_certfile={tls / 'client.pem'}&ssl_keyfile={tls / 'client.key'}"
             "&ssl_cert_reqs=required")
    cred = f"{user}:{quote(password, safe='')}@" if user else ""
    return f"rediss://{cred}127.0.0.1:{port}/0?{query}"


def _answers(url: str) -> bool:
    try:
        return connect(url, socket_connect_timeout=1).ping()
    except (redis.ConnectionError, OSError):
        return False


def test_the_tls_redis_refuses_clients_without_password_or_certificate(tls_redis):
    url, port, tls = tls_redis
    with pytest.raises(redis.AuthenticationError):
        connect(url.replace(quote(PASSWORD, safe=""), "wrong")).ping()
    no_cert = f"rediss://libra:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0?ssl_ca_certs={tls / 'ca.pem'}"
    with pytest.raises(redis.ConnectionError):
        connect(no_cert, socket_connect_timeout=2).ping()
    with pytest.raises(redis.ConnectionError):
        connect(f"redis://libra:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0", socket_connect_timeout=2).ping()


@pytest.mark.slow
def test_a_job_over_tls_with_an_acl_user_leaks_no_secret(tls_redis, tmp_path):
    """Workers, controller, agent and rq actions all on rediss:// as user ``libra``; then grep for the password."""
    url, _port, _tls = tls_redis
    r = connect(url)
    run_dir = sim_job(r, url, tmp_path, time_scale=20.0, control={"mode": "pinned"}, job={"steps": 3})
    env = {**{k: v for k, v in os.environ.items() if k != ENV_URL}, ENV_URL: url}
    handle = start_local_control(load_run_config(run_dir), run_dir, url, slots=2, node=NODE, interval_s=1.0)
    sampler = start_sampler(r, JOB, run_dir, 0.5)   # metrics.jsonl, as libra-ctl run keeps it
    argvs: dict[int, bytes] = {}
    try:
        wait_for(lambda: r.hexists(AGENTS, NODE), 60, "the agent over TLS")
        actions.ensure(r, NODE, {"job": JOB, "worker": "feeder-0", "role": "feeder", "slots": [],
                                 "run_dir": str(run_dir), "backend": "sim"})
        pids = [p.pid for _n, p in handle.procs]

        def watch() -> bool:
            for raw in r.hvals(agent_procs(NODE)):
                pids.append(json.loads(raw)["pid"])
            for pid in pids:
                try:
                    argvs[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
                except (FileNotFoundError, ProcessLookupError):
                    pass
            return r.hget(JobKeys(JOB).state, "phase") == b"trained"

        wait_for(watch, 180, "3 learner steps over TLS")
        status = [subprocess.run([sys.executable, "-m", "pipeline.cli", "status", *flag], cwd=ROOT, env=env,
                                 capture_output=True, timeout=60) for flag in ([], ["--json"])]
        handle.check()
    finally:
        sampler.stop()
        handle.stop()
    status += [subprocess.run([sys.executable, "-m", "pipeline.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                              timeout=120) for argv in (["audit", "--job", JOB, "--json"],)]
    assert all(s.returncode == 0 for s in status), [s.stderr for s in status]
    assert json.loads(status[1].stdout)["jobs"][0]["name"] == JOB
    a = audit(r, JOB, str(run_dir))
    assert a["ok"], a["problems"]
    roles = {json.loads(v)["role"] for v in r.hvals(JobKeys(JOB).workers)}
    assert {"feeder", "rollout", "reward", "learner"} <= roles
    assert len(argvs) >= 5                                     # controller, agent, feeder and the stage workers
    assert not [pid for pid, argv in argvs.items() if secret_hits(argv)]
    assert not [s for s in status if secret_hits(s.stdout + s.stderr)]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"manifest.json", "metrics.jsonl", "events.jsonl"} <= {p.name for p in files}
    assert not [str(p) for p in files if secret_hits(p.read_bytes())]
    private = [run_dir / "manifest.json", *(run_dir / "logs").iterdir()]
    assert not [str(p) for p in private if mode(p) != 0o600]
