"""``libra-ctl``: the command line. Each subcommand loads what it needs and calls one function.

Exit codes: 0 success, 1 a run or check failed, 2 bad input (config, arguments).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from pipeline import config as config_mod

# Modules that add their own subcommands with ``add_commands(subparsers)``;
# each imports its heavy dependencies inside its handlers, so --help stays fast.
COMMAND_MODULES: list[str] = [
    "pipeline.audit",  # audit, dlq
    "pipeline.prometheus",  # metrics-serve (issue 6)
    "pipeline.trace",  # trace (issue 6)
    "pipeline.doctor",  # doctor (issue 6)
    "pipeline.top",  # top (issue 6)
    "pipeline.report",  # report (issue 6)
    "pipeline.agent", "pipeline.controller",  # agent; controller, scale, drain, events (issue 4)
]
from pipeline.redisconn import ENV_URL, connect


def find_redis_url(explicit: str | None) -> str:
    """--redis, else $LIBRA_REDIS_URL, else the embedded server of the newest live local run."""
    if explicit:
        return explicit
    if os.environ.get(ENV_URL):
        return os.environ[ENV_URL]
    runs = sorted(Path("runs").glob("*/redis.url"), key=lambda p: p.stat().st_mtime, reverse=True)
    for p in runs:
        url = p.read_text().strip()
        if url.startswith("unix://") and not Path(url[len("unix://"):]).exists():
            continue
        return url
    raise SystemExit(f"no Redis to talk to: pass --redis URL or set {ENV_URL} "
                     "(or start a job with libra-ctl run in this directory)")


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
    from pipeline.status import format_status, status

    st = status(connect(find_redis_url(args.redis)), args.job)
    print(json.dumps(st, indent=2) if args.json else format_status(st))
    return 0


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

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from pipeline import bench_policy, bench_streams

    bench_policy.add_parser(bench_sub)
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
