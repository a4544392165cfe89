"""``libra-ctl``: the command line. Each subcommand loads what it needs and calls one function.

Exit codes: 0 success, 1 a run or check failed, 2 bad input (config, arguments).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from pipeline import argtypes, config as config_mod
from pipeline.dataplane.keys import BadName, check_path
from pipeline.dataplane.redisconn import ENV_URL, connect, find_redis_url, refusal
from pipeline.redaction import redact, redact_tree, write_private

SHARED_REDIS_DIR = "runs/redis"   # where ``libra-ctl redis`` keeps the embedded server of a Procfile
REDIS_WAIT_S = 120.0
OTHER_JOBS_AFTER_S = 5.0   # a pool worker waiting this long for its job names the jobs that do run
# On SIGTERM the server waits this long for its clients to leave (the agent drains its workers through it);
# honcho sends SIGKILL 5 s after SIGTERM.
REDIS_LINGER_S = 4.0

# Modules that add their own subcommands with ``add_commands(subparsers)``;
# each imports its heavy dependencies inside its handlers, so --help stays fast.
COMMAND_MODULES: list[str] = [
    "pipeline.observe.audit",       # audit, dlq
    "pipeline.observe.prometheus",  # metrics-serve
    "pipeline.observe.trace",       # trace
    "pipeline.observe.doctor",      # doctor
    "pipeline.observe.top",         # top
    "pipeline.observe.report",      # report
    "pipeline.control.agent",       # agent
    "pipeline.control.commands",    # scale, drain, events
    "pipeline.sim.job",             # sim-job
    "pipeline.chaos",               # chaos
    "pipeline.verify_resume",       # verify-resume
    "pipeline.experiment",          # baseline, experiment
]


def cmd_run(args) -> int:
    from pipeline.dataplane.lifeline import watch_parent
    from pipeline.run import run_job

    watch_parent()   # under libra-ctl experiment: stop (as on SIGTERM) when the experiment is gone
    cfg = config_mod.load(args.config, args.set or [])
    return run_job(cfg, sys.argv, join_wait_s=args.join_wait)


def cmd_resume(args) -> int:
    from pipeline.experiment import INVOCATION, ExperimentError, resume
    from pipeline.run import RunFailed, resume_job

    if any((Path(args.run_dir) / f).is_file() for f in (INVOCATION, "experiment.json", "baseline.json")):
        # an experiment's or a baseline's directory (one without invocation.json is refused, saying why)
        try:
            return resume(args.run_dir)
        except ExperimentError as exc:
            print(f"libra-ctl resume: {exc}", file=sys.stderr)
            return 2
    try:
        return resume_job(Path(check_path("run directory", args.run_dir)), sys.argv)
    except RunFailed as exc:
        print(f"libra-ctl: {exc}", file=sys.stderr)
        return 2


def cmd_status(args) -> int:
    from pipeline.observe.status import format_status, status

    r = connect(find_redis_url(args.redis))
    if args.job:
        from pipeline.control.commands import known_job

        known_job(r, args.job)   # a typo is said, not shown as "no jobs"
    st = status(r, args.job)
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def cmd_controller(args) -> int:
    """The controller process: the reconcile loop, and Prometheus /metrics for every job on its Redis."""
    import signal

    import structlog

    from pipeline import logs
    from pipeline.control.loop import Controller
    from pipeline.dataplane.lifeline import ORPHAN_EXIT_S, watch_parent

    watch_parent(exit_after_s=ORPHAN_EXIT_S)   # under libra-ctl run: end (as on SIGTERM) when the run is gone
    structlog.contextvars.bind_contextvars(role="controller")
    log = logs.configure(None, "controller")
    ctl = Controller(connect(find_redis_url(args.redis)), interval_s=args.interval, log=log)

    def on_signal(signum, _frame):
        log.info("stop_requested", signal=signal.Signals(signum).name)
        ctl.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.once:
        if ctl.tick():
            return 0
        print("libra-ctl controller --once: another controller holds the lease (it acts on this Redis); did nothing",
              file=sys.stderr)
        return 1
    metrics = _serve_metrics(ctl.r, args.metrics_port, args.metrics_host, log)
    log.info("controller_started", interval_s=args.interval, metrics_port=args.metrics_port)
    try:
        ctl.run()
    finally:
        if metrics is not None:
            metrics.stop()
    return 0


def _serve_metrics(r, port: int, host: str, log):
    """Prometheus /metrics for every job on this Redis, on ``host`` only; a taken port is logged, not fatal."""
    if not port:
        return None
    from pipeline.observe.prometheus import serve

    try:
        server = serve(r, port, host=host)
    except OSError as exc:
        log.warning("metrics_port_unavailable", port=port, host=host, error=str(exc))
        return None
    log.info("metrics_serving", url=server.url)
    return server


def _stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set (honcho stops a process with SIGTERM)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stop.set())
    return stop


def shared_redis_url(explicit: str | None, data_dir: str | Path) -> str | None:
    """--redis, else $LIBRA_REDIS_URL, else the URL ``libra-ctl redis`` wrote into ``data_dir``; None if none yet."""
    if explicit or os.environ.get(ENV_URL):
        return explicit or os.environ[ENV_URL]
    path = Path(data_dir) / "redis.url"
    return path.read_text().strip() if path.exists() else None


def wait_for_redis(explicit: str | None, data_dir: str | Path, timeout_s: float,
                   stop: threading.Event | None = None, waiting=None) -> str | None:
    """The URL of ``shared_redis_url`` once that server answers PING; None after ``timeout_s`` or a stop.

    ``waiting(url)``, if given, is called once, when the first try finds no server (``url`` None: none named yet).
    """
    import redis

    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    said = waiting is None
    while not stop.is_set():
        url = shared_redis_url(explicit, data_dir)
        if url:
            try:
                if connect(url, socket_connect_timeout=2, socket_timeout=2).ping():
                    return url
            except redis.RedisError as exc:
                if refusal(exc):
                    raise   # it is up and refuses the URL's credentials or certificates: waiting changes nothing
                # else not up yet (the Procfile's redis line starts beside us)
        if not said and timeout_s > 0:
            waiting(url)
            said = True
        if time.monotonic() >= deadline:
            return None
        stop.wait(0.2)
    return None


def cmd_redis(args) -> int:
    """``libra-ctl redis``: the Redis of a Procfile, in the foreground; ``--wait [-- CMD]``: wait for it."""
    then = args.then[1:] if args.then[:1] == ["--"] else args.then
    if then and not args.wait:   # a Procfile line missing --wait would start a second server, not CMD
        print(f"libra-ctl redis: a command to run ({' '.join(then)}) needs --wait: libra-ctl redis --wait -- CMD",
              file=sys.stderr)
        return 2
    if args.wait:
        url = wait_for_redis(args.redis, args.dir, args.timeout)
        if url is None:
            where = shared_redis_url(args.redis, args.dir) or f"{args.dir}/redis.url (libra-ctl redis writes it)"
            print(f"libra-ctl redis: no Redis answered at {redact(where)} within {args.timeout:g}s", file=sys.stderr)
            return 1
        if then:
            try:
                os.execvpe(then[0], then, {**os.environ, ENV_URL: url})
            except OSError as exc:   # a typo in a Procfile line: said in one line, as a shell would
                print(f"libra-ctl redis: cannot run {then[0]}: {exc.strerror or exc}", file=sys.stderr)
                return 127
        print(url)
        return 0
    stop = _stop_on_signals()
    given = args.redis or os.environ.get(ENV_URL)
    if given:
        # a Redis of the user's: nothing to serve; stay up, as honcho stops everything when a line exits
        print(f"redis: using {redact(given)} ({ENV_URL}); not starting a server", flush=True)
        stop.wait()
        return 0
    return _serve_redis(Path(args.dir), stop)


def _serve_redis(data_dir: Path, stop: threading.Event) -> int:
    """The embedded server (AOF, noeviction) on a unix socket under ``data_dir``, until SIGTERM or SIGINT."""
    from pipeline.dataplane.redisconn import EmbeddedRedis

    if wait_for_redis(None, data_dir, 0.0):
        print(f"libra-ctl redis: a server already runs in {data_dir} ({(data_dir / 'redis.url').read_text().strip()})",
              file=sys.stderr)
        return 1
    try:
        server = EmbeddedRedis(data_dir).start()
    except RuntimeError as exc:   # another libra-ctl redis starting on this directory holds its lock
        print(f"libra-ctl redis: {exc}", file=sys.stderr)
        return 1
    url_file = data_dir / "redis.url"
    write_private(url_file, server.url + "\n")   # a unix socket: no secret, but the socket's place is ours
    print(f"redis: serving at {server.url} (data in {data_dir}); export {ENV_URL}={server.url}", flush=True)
    try:
        stop.wait()
        _wait_for_clients_to_leave(server.url, REDIS_LINGER_S)
    finally:
        url_file.unlink(missing_ok=True)
        server.stop()
    print("redis: stopped", flush=True)
    return 0


def _wait_for_clients_to_leave(url: str, timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    try:
        client = connect(url, socket_timeout=2)
        while len(client.client_list()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    except redis.RedisError:
        pass   # the server is gone already


def cmd_worker(args) -> int:
    """``libra-ctl worker ROLE --job J``: one stage worker outside the agents (a Procfile pool, or by hand).

    Waits for Redis and for the job to run there, takes a stable id (see
    ``dataplane.worker.claim_external_id``), then becomes the worker: it execs
    the module the agents' command table names for the job's backend, with
    ``--external``. No agent starts, restarts or kills it.
    """
    from pipeline.control.agent import worker_argv
    from pipeline.control.commands import running_jobs
    from pipeline.control.job import load_job
    from pipeline.dataplane.keys import JobKeys
    from pipeline.dataplane.worker import NODE_ENV, IdTaken, live_run_dir, this_node

    keys = JobKeys(args.job)   # a name no job can have is refused now (BadName: exit 2), not after the waits
    stop = _stop_on_signals()
    node = args.node or this_node()

    def waiting(url: str | None) -> None:
        where = redact(url) if url else f"the URL in {SHARED_REDIS_DIR}/redis.url (libra-ctl redis writes it)"
        print(f"worker: waiting up to {REDIS_WAIT_S:g}s for Redis at {where}; pass --redis URL or set {ENV_URL}",
              flush=True)

    url = wait_for_redis(args.redis, SHARED_REDIS_DIR, REDIS_WAIT_S, stop, waiting)
    if url is None:
        print(f"libra-ctl worker: no Redis answered within {REDIS_WAIT_S:g}s: pass --redis URL or set {ENV_URL}",
              file=sys.stderr)
        return 130 if stop.is_set() else 1
    r = connect(url)
    print(f"worker: waiting for job {args.job} to run on {redact(url)}", flush=True)
    others_said, waited_from = None, time.monotonic()
    while live_run_dir(r, keys) is None:
        if stop.wait(0.2):
            return 130
        if time.monotonic() - waited_from > OTHER_JOBS_AFTER_S:
            # a pool line of another job's name (LIBRA_JOB against job.name) would sit idle all run, unsaid
            others = [j for j in running_jobs(r) if j != args.job]
            if others and others != others_said:
                print(f"worker: job {args.job} does not run on this Redis, and {', '.join(others)} "
                      f"{'does' if len(others) == 1 else 'do'}: still waiting for {args.job} (under a Procfile, "
                      f"LIBRA_JOB must be job.name of LIBRA_CONFIG)", flush=True)
                others_said = others
    info = load_job(r, args.job)
    if info is None:
        print(f"libra-ctl worker: cannot read the manifest of job {args.job} in {live_run_dir(r, keys)}; a worker "
              "needs the run directory (shared storage on another machine)", file=sys.stderr)
        return 2
    try:
        wid = _claim_id(r, keys, args.role, node, args.worker_id, stop)
    except IdTaken as exc:
        print(f"libra-ctl worker: {exc}", file=sys.stderr)
        return 2
    if wid is None:
        return 130
    argv = worker_argv(info.backend, args.role, info.run_dir, wid) + ["--external"]
    print(f"worker: {wid} ({info.backend} {args.role}) joins job {args.job}; log: {info.run_dir}/logs/{wid}.jsonl",
          flush=True)
    os.execve(argv[0], argv, {**os.environ, ENV_URL: url, NODE_ENV: node, "PYTHONUNBUFFERED": "1"})
    return 0   # not reached: execve replaces this process


def _claim_id(r, keys, role: str, node: str, want: str | None, stop: threading.Event) -> str | None:
    """Our stable id; a learner queues (its record refreshed each second) while an agent's holds learner-0."""
    from pipeline.dataplane.worker import claim_external_id

    said = False
    while (wid := claim_external_id(r, keys, role, node, want=want)) is None:
        if not said:
            print("worker: the job's learner runs under an agent; queued until the controller drains it", flush=True)
            said = True
        if stop.wait(1.0):
            me = (os.getpid(), node)   # a pid alone is not ours: containers on other nodes are pid 1 too
            queued = [w for w, rec in ((w, json.loads(raw)) for w, raw in r.hgetall(keys.workers).items())
                      if (rec.get("pid"), rec.get("node")) == me]
            if queued:
                r.hdel(keys.workers, *queued)
            return None
    return wid


def cmd_config(args) -> int:
    if args.reference:
        print(config_mod.reference())
        return 0
    cfg = config_mod.load(args.config, args.set or [])
    print(json.dumps(redact_tree(cfg.to_dict()), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="libra-ctl", description="Run and steer Libra RL post-training jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job: Redis if needed, feeder, workers, progress, summary")
    run.add_argument("config", help="job TOML file, e.g. examples/quickstart.toml")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    run.add_argument("--join-wait", type=argtypes.seconds_or_none, default=0.0, metavar="S",
                     help="wait up to S seconds for a controller and an agent starting beside this run on its Redis "
                          "(a Procfile) before starting the missing ones (default: join only what is there)")
    run.set_defaults(func=cmd_run)

    rs = sub.add_parser("resume", help="continue a stopped or crashed run from its latest checkpoint, or the "
                                       "unfinished runs of an experiment or baseline")
    rs.add_argument("run_dir", help="the run directory, runs/<id>; or an experiment's or baseline's directory, "
                                    "runs/experiments/<id>")
    rs.set_defaults(func=cmd_resume)

    st = sub.add_parser("status", help="jobs, stages (stream length, pending, lag, rate) and workers")
    st.add_argument("--json", action="store_true")
    st.add_argument("--job")
    st.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL} or the newest local run's)")
    st.set_defaults(func=cmd_status)

    cf = sub.add_parser("config", help="print the resolved config, or the reference of every key")
    cf.add_argument("config", nargs="?")
    cf.add_argument("--set", action="append", metavar="KEY=VALUE")
    cf.add_argument("--reference", action="store_true")
    cf.set_defaults(func=cmd_config)

    c = sub.add_parser("controller", help="the reconcile loop: moves slots between stages (one acts at a time)")
    c.add_argument("--interval", type=argtypes.seconds, default=10.0, help="seconds between reconciles (control.interval_s)")
    c.add_argument("--once", action="store_true", help="one reconcile, then exit")
    c.add_argument("--metrics-port", type=argtypes.port, default=9464,
                   help="serve Prometheus /metrics on this port (0: off; control.metrics_port)")
    c.add_argument("--metrics-host", default="127.0.0.1",
                   help="address /metrics binds (0.0.0.0: every interface; control.metrics_host)")
    c.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL})")
    c.set_defaults(func=cmd_controller)

    from pipeline.dataplane.keys import ROLES

    w = sub.add_parser("worker", help="one stage worker outside the agents (a Procfile pool): joins a running job")
    w.add_argument("role", choices=ROLES)
    w.add_argument("--job", required=True, help="the job to join (job.name); waits until it runs")
    w.add_argument("--node", help="node name in the worker's id (default: $LIBRA_NODE, else the short host name)")
    w.add_argument("--worker-id", help="this id instead of <role>-<node>-ext<k> (the learner's is learner-0)")
    w.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL}, else the server of libra-ctl redis)")
    w.set_defaults(func=cmd_worker)

    rd = sub.add_parser("redis", help="the Redis of a Procfile: the embedded server in the foreground, or --wait")
    rd.add_argument("--dir", default=SHARED_REDIS_DIR, help="data, socket and redis.url of the embedded server")
    rd.add_argument("--wait", action="store_true",
                    help="wait until the Redis answers, then print its URL, or exec the command after --")
    rd.add_argument("--timeout", type=argtypes.seconds_or_none, default=REDIS_WAIT_S, help="seconds --wait waits")
    rd.add_argument("--redis", help=f"a Redis URL (default: ${ENV_URL}, else the embedded server's)")
    rd.add_argument("then", nargs=argparse.REMAINDER, help="with --wait: -- CMD ... run with $LIBRA_REDIS_URL set")
    rd.set_defaults(func=cmd_redis)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pipeline import bench_rollout
    from pipeline.sim import bench_allocator, bench_streams

    bench_allocator.add_parser(bench_sub)
    bench_streams.add_parser(bench_sub)
    bench_rollout.add_parser(bench_sub)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    import redis

    from pipeline.dataplane.redisconn import BadRedisUrl, RedisUnavailable

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:   # the reader went away (`libra-ctl status --json | head`): the rest has nowhere to go
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # so the exit's flush does not fail too
        return 141
    except config_mod.ConfigError as exc:
        print(f"libra-ctl: config error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except BadRedisUrl as exc:
        print(f"libra-ctl: {exc}", file=sys.stderr)
        return 2
    except BadName as exc:   # a job name, worker id or path that cannot become a key or a file name
        print(f"libra-ctl: {exc}", file=sys.stderr)
        return 2
    except config_mod.BadInput as exc:   # the message names the command
        print(exc, file=sys.stderr)
        return 2
    except RedisUnavailable as exc:   # the message says which
        print(f"libra-ctl: {redact(str(exc))}", file=sys.stderr)
        return 1
    except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.NoPermissionError) as exc:
        where = f" at {redact(args.redis)}" if getattr(args, "redis", None) else ""
        # up, but refusing the URL's credentials, its user's permissions or its certificates; else unreachable
        print(f"libra-ctl: Redis{where} {refusal(exc) or 'unreachable'}: {redact(str(exc))}", file=sys.stderr)
        return 1
    except redis.ResponseError as exc:
        if "DB index" not in str(exc):   # a server answering a command with an error is a bug to show whole
            raise
        # the URL's database (/N or ?db=N) is not one the server has: a managed or cluster Redis has db 0 only
        where = f" at {redact(args.redis)}" if getattr(args, "redis", None) else ""
        print(f"libra-ctl: Redis{where} refused the database of its URL: {exc}; use one it has (0 by default)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
