"""``libra-ctl``: the command line. Each subcommand loads what it needs and calls one function.

Exit codes: 0 success, 1 a run or check failed, 2 bad input (config, arguments).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from pipeline import config as config_mod
from pipeline.dataplane.redisconn import ENV_URL, connect, find_redis_url

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
]


def cmd_run(args) -> int:
    from pipeline.run import run_job

    cfg = config_mod.load(args.config, args.set or [])
    return run_job(cfg, sys.argv)


def cmd_resume(args) -> int:
    from pipeline.run import RunFailed, resume_job

    try:
        return resume_job(Path(args.run_dir), sys.argv)
    except RunFailed as exc:
        print(f"libra-ctl: {exc}", file=sys.stderr)
        return 2


def cmd_status(args) -> int:
    from pipeline.observe.status import format_status, status

    st = status(connect(find_redis_url(args.redis)), args.job)
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


def cmd_controller(args) -> int:
    """The controller process: the reconcile loop, and Prometheus /metrics for every job on its Redis."""
    import signal

    import structlog

    from pipeline import logs
    from pipeline.control.loop import Controller

    structlog.contextvars.bind_contextvars(role="controller")
    log = logs.configure(None, "controller")
    ctl = Controller(connect(find_redis_url(args.redis)), interval_s=args.interval, log=log)

    def on_signal(signum, _frame):
        log.info("stop_requested", signal=signal.Signals(signum).name)
        ctl.stop_event.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.once:
        return 0 if ctl.tick() else 1
    metrics = _serve_metrics(ctl.r, args.metrics_port, log)
    log.info("controller_started", interval_s=args.interval, metrics_port=args.metrics_port)
    try:
        ctl.run()
    finally:
        if metrics is not None:
            metrics.stop()
    return 0


def _serve_metrics(r, port: int, log):
    """Prometheus /metrics for every job on this Redis; a taken port is logged, not fatal."""
    if not port:
        return None
    from pipeline.observe.prometheus import serve

    try:
        server = serve(r, port, host="0.0.0.0")
    except OSError as exc:
        log.warning("metrics_port_unavailable", port=port, error=str(exc))
        return None
    log.info("metrics_serving", url=f"http://0.0.0.0:{port}/metrics")
    return server


def cmd_config(args) -> int:
    if args.reference:
        print(config_mod.reference())
        return 0
    cfg = config_mod.load(args.config, args.set or [])
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="libra-ctl", description="Run and steer Libra RL post-training jobs.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job: Redis if needed, feeder, workers, progress, summary")
    run.add_argument("config", help="job TOML file, e.g. examples/quickstart.toml")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    run.set_defaults(func=cmd_run)

    rs = sub.add_parser("resume", help="continue a stopped or crashed run from its latest checkpoint")
    rs.add_argument("run_dir", help="the run directory, runs/<id>")
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
    c.add_argument("--interval", type=float, default=10.0, help="seconds between reconciles (control.interval_s)")
    c.add_argument("--once", action="store_true", help="one reconcile, then exit")
    c.add_argument("--metrics-port", type=int, default=9464,
                   help="serve Prometheus /metrics on this port (0: off; control.metrics_port)")
    c.add_argument("--redis", help=f"Redis URL (default: ${ENV_URL})")
    c.set_defaults(func=cmd_controller)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pipeline.sim import bench_allocator, bench_streams

    bench_allocator.add_parser(bench_sub)
    bench_streams.add_parser(bench_sub)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except config_mod.ConfigError as exc:
        print(f"libra-ctl: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
