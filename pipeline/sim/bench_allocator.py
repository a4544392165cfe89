"""``libra-ctl bench policy WORKLOAD.toml``: the allocator's throughput benchmark.

Registered on the ``bench`` subcommand by ``pipeline.cli`` (``add_parser``);
runs in the CLI process. ``run_bench`` runs one workload under several modes
(``docs/workloads.md``: sync, static, static-best, libra, ideal) on the
discrete-event engine (``pipeline.sim.des``), and with ``engine="live"`` also
runs the asynchronous modes on the real control plane (``pipeline.sim.bench_live``);
it returns the README's JSON shape, plus per-mode timelines under the extra key
``details`` (kept out of ``--json``). ``format_table`` is the terminal view, ``plot`` the picture of
allocation and throughput over time. A multi-job workload (``[[jobs]]``) runs
through ``pipeline.sim.bench_pool``: its pool modes on the des engine, and with
``engine="live"`` static and libra on the control plane too. ``--sweep N`` runs N
random workloads instead (``pipeline.sim.bench_sweep``, each through ``run_workload``).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from pipeline import argtypes
from pipeline.control.allocator import AdmissionError
from pipeline.dataplane.lifeline import raise_interrupt
from pipeline.sim import bench_pool, bench_sweep, des, fluid
from pipeline.sim.result import ModeResult
from pipeline.sim.sync import simulate_sync
from pipeline.sim.bench_live import (LIVE_MODES, MAX_AUTO_SCALE, WALL_RATE, LiveBench, LiveEngineError, LiveSettings,
                                     live_summary)
from pipeline.control.allocator import Allocation
from pipeline.sim.workload import MAX_GPUS, WorkloadError, load_workload

MODES = ("sync", "static", "static-best", "libra", "ideal")
ENGINES = ("des", "live")
BASELINES = ("sync", "static", "static-best", "ideal")
Report = Callable[[str], None]


class BenchInputError(ValueError):
    """An unknown mode or engine; the message says the choices."""


def run_bench(workload_path: str | Path, modes=MODES, engine: str = "des", seed: int | None = None,
              report: Report | None = None, live: LiveSettings | None = None) -> dict:
    """Run ``modes`` of one workload; returns {"workload", "modes", "ratios", "details"}.

    ``seed`` defaults to the workload's [job] seed. ``report`` receives
    progress lines (the CLI prints them on stderr). With ``engine="live"``
    the modes of ``bench_live.LIVE_MODES`` run on the control plane
    (``live`` settings) after the des engine has run every mode, and the
    result adds ``engine`` and ``live_vs_des`` (each live mode's rate over
    its des rate). A multi-job workload runs ``bench_pool``'s modes instead
    (live: ``static`` and ``libra`` on the control plane, every job at once)
    and adds ``jobs`` (their names), per-job figures under each mode's
    ``jobs``, and ``not_applicable`` (modes asked that have no multi-job
    meaning). Raises WorkloadError for a bad workload (or job minimums the
    pool cannot hold), BenchInputError for an unknown mode or engine or a
    workload the live engine cannot run, LiveEngineError when a live run fails.
    """
    modes = _check_modes(modes)
    if engine not in ENGINES:
        raise BenchInputError(f"unknown engine {engine!r}: use {' or '.join(ENGINES)}")
    wl = load_workload(workload_path)
    say = report or (lambda line: None)
    live = live or LiveSettings()
    if engine == "live":
        try:
            live.check(wl)
        except ValueError as exc:
            raise BenchInputError(str(exc)) from None
    if wl.multi_job:
        return _run_pool(wl, workload_path, modes, engine, seed, say, live)
    seed = wl.job.seed if seed is None else seed
    results, details = _run_des(wl, modes, seed, say, " (des)" if engine == "live" else "")
    out = {"workload": wl.name}
    live_modes = [m for m in modes if m in LIVE_MODES]
    if engine == "live" and not live_modes:
        say(f"live: none of the modes asked runs live ({', '.join(LIVE_MODES)} do); the des engine's results stand")
    elif engine == "live":
        by_des = dict(results)
        for mode in modes:
            details[mode]["engine"] = "des"
        _run_live(wl, workload_path, live_modes, live, seed, results, details, say)
        out["engine"] = "live"
        out["live_vs_des"] = {m: results[m].trajectories_per_s / by_des[m].trajectories_per_s
                              for m in modes if details[m]["engine"] == "live" and by_des[m].trajectories_per_s}
    out.update(modes={m: results[m].report() for m in modes}, ratios=_ratios(results), details=details)
    return out


def run_workload(wl, modes, seed: int | None = None, report: Report | None = None) -> dict:
    """One parsed single-job workload on the des engine: run_bench's result without reading a file.

    Called by the sweep (``run_sweep``) for each generated workload; ``seed``
    defaults to the workload's [job] seed.
    """
    results, details = _run_des(wl, _check_modes(modes), wl.job.seed if seed is None else seed,
                                report or (lambda line: None))
    return {"workload": wl.name, "modes": {m: r.report() for m, r in results.items()},
            "ratios": _ratios(results), "details": details}


def _run_des(wl, modes: list[str], seed: int, say: Report, tag: str = "") -> tuple[dict[str, ModeResult], dict]:
    """Each mode of one job on the des engine, in order: its result and details (with wall seconds)."""
    results: dict[str, ModeResult] = {}
    details: dict[str, dict] = {}
    for mode in modes:
        t0 = time.perf_counter()
        results[mode], details[mode] = _run_mode(wl, mode, seed, results, say)
        details[mode]["wall_s"] = time.perf_counter() - t0
        say(f"{mode}{tag}: {results[mode].trajectories_per_s:.2f} trajectories/s "
            f"({details[mode]['wall_s']:.1f} s wall)")
    return results, details


def _run_pool(wl, workload_path, modes: list[str], engine: str, seed: int | None, say: Report,
              live: LiveSettings) -> dict:
    """A multi-job workload: the modes that apply to a pool on the des engine, then (live) static and libra
    on the control plane; and why the other modes do not apply."""
    skipped = [m for m in modes if m not in bench_pool.POOL_MODES]
    for m in skipped:
        say(f"{m}: not applicable to multi-job workloads ({bench_pool.NOT_APPLICABLE[m]})")
    runnable = [m for m in modes if m in bench_pool.POOL_MODES]
    if not runnable:
        raise BenchInputError(f"{', '.join(skipped)}: not applicable to multi-job workloads; "
                              f"choose from {','.join(bench_pool.POOL_MODES)}")
    try:
        out = bench_pool.run_pool_bench(wl, runnable, seed, say)
    except AdmissionError as exc:
        raise WorkloadError(f"{wl.source}: {exc}: lower the jobs' min_gpus or add GPUs to [cluster]") from None
    if engine == "live" and not any(m in bench_pool.LIVE_POOL_MODES for m in runnable):
        say(f"live: none of the modes asked runs live ({', '.join(bench_pool.LIVE_POOL_MODES)} do); the des "
            "engine's results stand")
    elif engine == "live":
        bench_pool.run_live_pool(wl, workload_path, out, live, seed, say)
    if skipped:
        out["not_applicable"] = {m: bench_pool.NOT_APPLICABLE[m] for m in skipped}
    return out


def _run_live(wl, workload_path, modes: list[str], settings: LiveSettings, seed: int, results: dict,
              details: dict, say: Report) -> None:
    """Replace the des results of ``modes`` by live runs (static-best at the split des found best)."""
    static = fluid.static_split(wl)
    splits = {"static": static, "libra": static}
    if "static-best" in modes:
        splits["static-best"] = Allocation(**results["static-best"].final_allocation)
    ran: dict[Allocation, str] = {}
    with LiveBench(wl, workload_path, settings, say, seed) as bench:
        for mode in modes:
            split, t0 = splits[mode], time.perf_counter()
            if mode == "static-best" and ran.get(split) == "static":
                results[mode], details[mode] = results["static"], {**details["static"], "same_run_as": "static"}
                say("static-best: the des engine's best split is the static split; the static run stands for it")
                continue
            results[mode], details[mode] = bench.run_mode(mode, split)
            details[mode]["wall_s"] = time.perf_counter() - t0
            if mode != "libra":
                ran[split] = mode
            say(f"{mode} (live): {results[mode].trajectories_per_s:.2f} trajectories/s "
                f"({details[mode]['wall_s']:.0f} s wall)")


def _check_modes(modes) -> list[str]:
    if isinstance(modes, str):
        modes = [m.strip() for m in modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise BenchInputError(f"unknown mode {bad[0]!r}: choose from {','.join(MODES)}" if bad
                         else f"no mode given: choose from {','.join(MODES)}")
    return [m for m in MODES if m in modes]     # canonical order, no duplicates


def _run_mode(wl, mode: str, seed: int, done: dict, say: Report) -> tuple[ModeResult, dict]:
    """One mode's result and its extra details (timeline, decisions, splits tried)."""
    progress = _throttled(say, mode)
    if mode == "ideal":
        r = ModeResult(trajectories_per_s=fluid.ideal_rate(wl))
        return r, {"phase_rates": [fluid.ideal_phase_rate(wl, ph) for ph in wl.job.phases],
                   "stale_floor": fluid.stale_floor(wl, seed)}
    if mode == "sync":
        r = simulate_sync(wl, seed, progress)
    elif mode in ("static", "libra"):
        control = des.LIBRA_CONTROL if mode == "libra" else None
        r = des.simulate_async(wl, fluid.static_split(wl), seed, control, progress=progress)
    else:
        r = _static_best(wl, seed, done.get("static"), progress, say)
    return r, {"timeline": r.timeline, "decisions": r.events, "sim_time_s": r.sim_time_s}


def _static_best(wl, seed: int, static: ModeResult | None, progress, say: Report) -> ModeResult:
    """Search the split that turns out best over the whole run (each candidate a full run)."""
    tried = []

    def run(a):
        say(f"static-best: trying rollout={a.rollout} learner={a.learner} reward={a.reward}")
        r = des.simulate_async(wl, a, seed, progress=progress)
        tried.append(a)
        return r

    known = {fluid.static_split(wl): static} if static is not None else {}
    _, r = fluid.search_static_best(wl, run, known)
    say(f"static-best: {len(tried) + len(known)} splits simulated")
    return r


def _ratios(results: dict[str, ModeResult]) -> dict[str, float]:
    if "libra" not in results:
        return {}
    lib = results["libra"].trajectories_per_s
    return {f"libra/{b}": lib / results[b].trajectories_per_s for b in BASELINES
            if b in results and results[b].trajectories_per_s > 0}


def _throttled(say: Report, mode: str, every_s: float = 2.0):
    """A sim progress callback that reports at most every ``every_s`` seconds of wall time."""
    last = [time.perf_counter()]

    def progress(step: int, steps: int, t_sim: float) -> None:
        now = time.perf_counter()
        if now - last[0] >= every_s:
            last[0] = now
            say(f"{mode}: step {step}/{steps} at {t_sim:.0f} simulated s")
    return progress


def readme_json(result: dict) -> dict:
    """The README's JSON shape: the result without its ``details``.

    A live run adds ``engine`` and ``live_vs_des``; a multi-job run ``jobs`` and ``not_applicable``.
    """
    return {k: result[k] for k in ("workload", "engine", "live_vs_des", "jobs", "modes", "ratios", "not_applicable")
            if k in result}


# --- terminal table -----------------------------------------------------------

_COLUMNS = (("mode", "{}", "mode"), ("traj/s", "{:.2f}", "trajectories_per_s"),
            ("gpu busy", "{:.1%}", "gpu_busy_frac"), ("learner wait", "{:.1%}", "learner_wait_frac"),
            ("stale p50", "{:.0f}", "staleness_p50"), ("stale p99", "{:.0f}", "staleness_p99"),
            ("dropped", "{:d}", "dropped_stale"), ("reconfigs", "{:d}", "reconfigurations"),
            ("final allocation", "{}", "final_allocation"))


def format_table(result: dict) -> str:
    """A fixed-width table, one row per mode, then the ratios (times are simulated seconds)."""
    if "jobs" in result:
        return bench_pool.format_pool_table(result)
    rows = [[c[0] for c in _COLUMNS]]
    for mode, m in result["modes"].items():
        row = []
        for _, fmt, key in _COLUMNS:
            v = mode if key == "mode" else m.get(key)
            if key == "final_allocation" and v is not None:
                v = " ".join(f"{k}={n}" for k, n in v.items() if n)
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [f"workload {result['workload']} (trajectories per simulated second)"]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if j in (0, len(r) - 1) else c.rjust(w)
                               for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    floor = result.get("details", {}).get("ideal", {}).get("stale_floor")
    if floor:
        lines += ["", f"stale floor: {floor['fraction']:.2%} of trajectories go stale at the ideal pace under any "
                      "allocation (groups whose slowest trajectory outlasts max_staleness + 1 steps less a weight "
                      "load): "
                      + "; ".join(f"phase {i + 1} {p['doomed']:.2%} (step {p['step_s']:.0f} s, {p['budget_s']:.0f} s "
                                  f"to be ready, slot time x{p['stretch']:.2f} for prefill stalls)"
                                  for i, p in enumerate(floor["phases"]))]
    if result["ratios"]:
        lines.append("")
        lines.append("  ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))
    return "\n".join(lines + live_summary(result))


# --- plot ---------------------------------------------------------------------

def plot(result: dict, path: str | Path) -> None:
    """GPUs per role and throughput per learner step over simulated time, one colour per mode.

    sync is colocated (every GPU does every stage), so it has no allocation
    line and its throughput is drawn as its run average. Needs matplotlib (an
    optional dependency): raises ImportError if it is missing. A multi-job
    result draws each job's GPUs and throughput instead (``bench_pool.draw_pool``).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_a, ax_r) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    if "jobs" in result:
        bench_pool.draw_pool(result, ax_a, ax_r)
    else:
        _draw_modes(result, ax_a, ax_r)
    ax_r.set_ylabel("trajectories/s (per learner step)")
    ax_r.set_xlabel("simulated seconds")
    for ax in (ax_a, ax_r):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_modes(result: dict, ax_a, ax_r) -> None:
    """One job's modes: GPUs per role on ``ax_a``, throughput on ``ax_r``."""
    end = 0.0
    for i, (mode, d) in enumerate(result.get("details", {}).items()):
        tl, color = d.get("timeline"), f"C{i}"
        if not tl:
            continue
        if mode == "sync":
            ax_r.axhline(result["modes"]["sync"]["trajectories_per_s"], color=color, ls=":", lw=1.5,
                         label="sync (run average)")
            continue
        t = [0.0] + [p["t"] for p in tl]
        for role, ls in (("rollout", "-"), ("learner", "--"), ("reward", ":")):
            n = [tl[0][role]] + [p[role] for p in tl]
            if any(n):
                ax_a.step(t, n, where="post", color=color, ls=ls, label=f"{mode} {role}")
        ax_r.plot(t[1:], [p["rate"] for p in tl], color=color, lw=1, label=mode)
        end = max(end, t[-1])
    if "ideal" in result["modes"]:
        ax_r.axhline(result["modes"]["ideal"]["trajectories_per_s"], color="k", ls="--", lw=1,
                     label="ideal (run average)")
    ax_a.set_ylabel("GPUs")
    ax_a.set_title(f"workload {result['workload']}: allocation and throughput")
    if end:
        ax_r.set_xlim(0, end * 1.02)


# --- command line -------------------------------------------------------------

def add_parser(subparsers) -> None:
    """Register ``policy`` on the ``bench`` subcommand's subparsers (called by pipeline.cli)."""
    p = subparsers.add_parser(
        "policy", help="throughput of the allocator (libra) against sync, static splits and the ideal bound",
        description="Run a workload (docs/workloads.md format) under several modes and report "
                    "trajectories per simulated second, beside the ideal bound.")
    p.add_argument("workload", nargs="?", help="workload TOML file, e.g. bench/drift.toml (or --sweep)")
    p.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)} (default: all; "
                                   f"with --sweep {','.join(bench_sweep.SWEEP_MODES)})")
    p.add_argument("--engine", default="des", choices=ENGINES,
                   help="des: discrete-event simulator; live: also run static, static-best and libra on a real "
                        "Redis, controller and agent with sim workers on compressed time (up to 64 slots); a "
                        "multi-job workload runs static and libra live, every job at once on the one agent")
    p.add_argument("--time-scale", type=float, default=LiveSettings.time_scale,
                   help=f"live: simulated seconds per wall second (default: {MAX_AUTO_SCALE:g}, or less where the "
                        f"workload's fastest phase would pass more than {WALL_RATE:,.0f} trajectories a wall second)")
    p.add_argument("--redis", help="live: Redis URL to run on (default: an embedded server, removed after)")
    p.add_argument("--runs-dir", default=LiveSettings.runs_dir,
                   help="live: where the run directories and logs go")
    p.add_argument("--json", metavar="OUT", help="write the README's JSON shape to OUT")
    p.add_argument("--plot", metavar="OUT.png", help="draw allocation and throughput over time (needs matplotlib)")
    p.add_argument("--seed", type=argtypes.whole, help="seed of the simulation (default: the workload's [job] seed); "
                                            "with --sweep, of the generated workloads (default 0)")
    p.add_argument("--sweep", type=int, metavar="N",
                   help="instead of a workload file, run N random workloads (pipeline/sim/workload_gen.py) "
                        "and report the distribution of libra/ideal")
    p.add_argument("--sweep-gpus", nargs=2, type=int, metavar=("MIN", "MAX"),
                   help="with --sweep: cluster sizes to draw from (default 16 1024, log-uniform)")
    p.add_argument("--save-worst", nargs="?", const="examples/bench", metavar="DIR",
                   help=f"with --sweep: write the minimum's workload to DIR/{bench_sweep.MIN_FILE} "
                        "(DIR default examples/bench)")
    p.set_defaults(func=cmd_bench_policy)


def cmd_bench_policy(args) -> int:
    """The subcommand: 0 done, 2 bad input (workload, modes, engine, missing matplotlib)."""
    def err(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.sweep is not None or args.save_worst is not None or args.sweep_gpus is not None:
        return _cmd_sweep(args, err)
    if args.workload is None:
        err("libra-ctl bench policy: give a workload file, or --sweep N for random workloads")
        return 2
    bad_out = argtypes.unwritable("--json", args.json) or argtypes.unwritable("--plot", args.plot)
    if bad_out:   # before the run, which may take minutes: not a traceback after it
        err(f"libra-ctl bench policy: {bad_out}")
        return 2
    if args.engine == "live":
        # a SIGTERM (timeout, CI cancel, systemd) unwinds like Ctrl-C, so the live engine stops the control
        # plane, its workers and the embedded Redis, which run in sessions of their own
        signal.signal(signal.SIGTERM, raise_interrupt)
    t0 = time.perf_counter()
    try:
        result = run_bench(args.workload, args.modes or MODES, args.engine, args.seed,
                           report=lambda line: err(f"bench policy: {line}"),
                           live=LiveSettings(time_scale=args.time_scale, redis_url=args.redis,
                                             runs_dir=args.runs_dir))
    except (WorkloadError, BenchInputError) as exc:
        err(f"libra-ctl bench policy: {exc}")
        return 2
    except LiveEngineError as exc:
        err(f"libra-ctl bench policy: live engine: {exc}")
        return 1
    except KeyboardInterrupt:
        err("libra-ctl bench policy: interrupted" + ("; the live engine's processes are stopped"
                                                     if args.engine == "live" else ""))
        return 130
    print(format_table(result))
    err(f"bench policy: done in {time.perf_counter() - t0:.1f} s wall")
    if args.json:
        Path(args.json).write_text(json.dumps(readme_json(result), indent=2) + "\n")
    if args.plot:
        try:
            plot(result, args.plot)
        except ImportError:
            err("libra-ctl bench policy: --plot needs matplotlib: pip install matplotlib")
            return 2
    return 0


def _cmd_sweep(args, err: Report) -> int:
    """``--sweep N``: 0 done, 2 bad input (a workload file too, a live engine, modes without libra and ideal)."""
    bad = ("--save-worst and --sweep-gpus need --sweep N" if args.sweep is None
           else "--sweep N generates its workloads: give no workload file" if args.workload
           else f"--sweep {args.sweep}: give at least one workload" if args.sweep < 1
           else "--sweep runs on the des engine: drop --engine live" if args.engine == "live"
           else "--plot draws one workload: drop it with --sweep" if args.plot
           else argtypes.unwritable("--json", args.json)
           or argtypes.unwritable("--save-worst", args.save_worst, directory=True))
    try:
        if bad:
            raise BenchInputError(bad)
        modes = _check_modes(args.modes or bench_sweep.SWEEP_MODES)
        bench_sweep.check_modes(modes)
    except (BenchInputError, ValueError) as exc:
        err(f"libra-ctl bench policy: {exc}")
        return 2
    t0 = time.perf_counter()
    try:
        gpus = tuple(args.sweep_gpus or bench_sweep.GPUS)
        if gpus[1] > MAX_GPUS:   # a later workload would draw a cluster the format refuses
            raise ValueError(f"{gpus[1]}: at most {MAX_GPUS:,} GPUs (docs/workloads.md)")
        bench_sweep.workload_at(args.seed or 0, 0, gpus)     # a bad range fails here, before any run
    except ValueError as exc:
        err(f"libra-ctl bench policy: --sweep-gpus: {exc}")
        return 2
    try:
        result = bench_sweep.run_sweep(args.sweep, args.seed or 0, modes,
                                       lambda wl, ms, say: run_workload(wl, ms, report=say),
                                       report=lambda line: err(f"bench policy: {line}"), gpus=gpus)
    except KeyboardInterrupt:   # each workload's line is printed as it ends: those figures are kept above
        err("libra-ctl bench policy: sweep interrupted")
        return 130
    print(bench_sweep.format_sweep(result))
    err(f"bench policy: sweep done in {time.perf_counter() - t0:.1f} s wall")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.save_worst is not None:
        paths = bench_sweep.save_min(result, args.save_worst)
        err(f"bench policy: the minimum's workload is in {paths[0]}")
        if len(paths) > 1:
            err(f"bench policy: the minimum's over the workloads whose stale floor allows the aims is in {paths[1]}")
    return 0
