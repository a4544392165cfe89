"""``libra-ctl bench policy`` on a multi-job workload (``[[jobs]]``): its modes, figures and table.

Called by ``pipeline.sim.bench_allocator.run_bench`` when the workload has
``[[jobs]]`` tables, in the CLI process. Definitions are those of
``docs/workloads.md``, "Multi-job workloads":

- ``static``: a fixed partition of the pool in proportion to each job's work
  W_j within its [min, max] share, each job at its first phase's best split of
  its part; a finished job's GPUs stay idle (``pipeline.sim.pool``);
- ``libra``: the pool policy (``allocator.plan`` over every job) drives the
  shares and splits from the shares it gives at time 0 (``pipeline.sim.pool``);
- ``ideal``: the makespan no allocation beats: the later of the benchmark spec's
  work bound, max(sum W_j / gpus, max T_j), and the best split of the pool
  among jobs and stages with minimums held and the learner at its real
  scaling (``pipeline.sim.fluid``, ``ideal_report``).

With ``--engine live``, ``run_live_pool`` then runs ``static`` and ``libra``
on the real control plane (``pipeline.sim.bench_live.LiveBench.run_pool``),
every job at once, and their figures replace the des ones.

Each mode reports per job its throughput (its trajectories over its finish
time), finish time and GPU-seconds below its ``min_gpus``; for the pool the
total rate (all trajectories over the makespan) and Jain's fairness index over
the jobs' throughput relative to their demand (their ideal rate alone on their
largest share).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pipeline.control import allocator
from pipeline.sim import des, fluid, pool
from pipeline.sim.bench_live import LiveBench, LiveSettings, live_summary
from pipeline.sim.pool import PoolResult
from pipeline.sim.workload import Workload

POOL_MODES = ("static", "libra", "ideal")
LIVE_POOL_MODES = ("static", "libra")     # what --engine live runs on the control plane; ideal is a bound
NOT_APPLICABLE = {
    "sync": "colocated synchronous training gives each job the whole pool in turn, which is not a shared pool",
    "static-best": "its hindsight search over splits of one job has no counterpart over shares of several jobs",
}
Report = Callable[[str], None]


def run_pool_bench(wl: Workload, modes: list[str], seed: int | None, say: Report) -> dict:
    """Run ``modes`` (a subset of ``POOL_MODES``) of a multi-job workload; the result of ``run_bench``.

    ``seed`` None: each job uses its own [[jobs]] seed; else job i uses seed + i.
    Raises ``allocator.AdmissionError`` when the pool cannot hold the jobs' minimums.
    """
    views = pool.job_views(wl)
    specs = pool.admit(wl)
    seeds = job_seeds(views, seed)
    demand = {name: demand_rate(views[name], specs[name], wl.cluster.gpus) for name in views}
    modes_out: dict[str, dict] = {}
    details: dict[str, dict] = {}
    for mode in modes:
        t0 = time.perf_counter()
        if mode == "ideal":
            modes_out[mode], details[mode] = ideal_report(wl, specs), {}
        else:
            r = _simulate(wl, mode, seeds)
            modes_out[mode] = pool_report(r, demand)
            details[mode] = {"shares": r.shares, "decisions": r.decisions, "sim_time_s": r.makespan_s,
                             "timelines": {j: m.timeline for j, m in r.jobs.items()}}
        details[mode]["wall_s"] = time.perf_counter() - t0
        say(f"{mode}: {modes_out[mode]['trajectories_per_s']:.2f} trajectories/s over the pool "
            f"({details[mode]['wall_s']:.1f} s wall)")
    return {"workload": wl.name, "jobs": list(views), "modes": modes_out, "ratios": _ratios(modes_out),
            "details": details}


def job_seeds(views: dict[str, Workload], seed: int | None) -> dict[str, int]:
    """Each job's seed: its own [[jobs]] seed, or ``seed + i`` for the i-th job when a seed is given."""
    return {name: v.job.seed if seed is None else seed + i for i, (name, v) in enumerate(views.items())}


def start_shares(wl: Workload, mode: str) -> dict[str, int]:
    """The GPUs each job starts with: the static partition, or libra's first pool plan."""
    return pool.static_shares(wl) if mode == "static" else pool.libra_shares(wl, des.LIBRA_CONTROL)


def _simulate(wl: Workload, mode: str, seeds: dict[str, int]) -> PoolResult:
    return pool.PoolSim(wl, start_shares(wl, mode), seeds, des.LIBRA_CONTROL if mode == "libra" else None).run()


def run_live_pool(wl: Workload, workload_path, result: dict, settings: LiveSettings, seed: int | None,
                  say: Report) -> None:
    """Run ``result``'s live modes (``LIVE_POOL_MODES``) on the control plane; their figures replace the des ones.

    Called by ``bench_allocator.run_bench`` for ``--engine live`` after
    ``run_pool_bench``. ``ideal`` stays the des bound. Adds ``engine``,
    ``live_vs_des`` (each live mode's pool rate over its des rate) and each
    mode's ``details[mode]["engine"]``; raises LiveEngineError when a live run fails.
    """
    views, g = pool.job_views(wl), wl.cluster.gpus
    specs = pool.admit(wl)
    seeds = job_seeds(views, seed)
    demand = {name: demand_rate(views[name], specs[name], g) for name in views}
    modes, details = result["modes"], result["details"]
    live_modes = [m for m in modes if m in LIVE_POOL_MODES]
    by_des = {m: modes[m]["trajectories_per_s"] for m in live_modes}
    for m in modes:
        details[m]["engine"] = "des"
    with LiveBench(wl, workload_path, settings, say, seed) as bench:
        for mode in live_modes:
            t0 = time.perf_counter()
            shares = start_shares(wl, mode)
            r, details[mode] = bench.run_pool(mode, views, {j: pool.start_split(views[j], shares[j]) for j in views},
                                              seeds)
            modes[mode] = pool_report(r, demand)
            details[mode]["wall_s"] = time.perf_counter() - t0
            say(f"{mode} (live): {modes[mode]['trajectories_per_s']:.2f} trajectories/s over the pool, below min "
                f"{modes[mode]['below_min_gpu_s']:.0f} GPU-s ({details[mode]['wall_s']:.0f} s wall)")
    result["engine"] = "live"
    result["live_vs_des"] = {m: modes[m]["trajectories_per_s"] / by_des[m] for m in live_modes if by_des[m]}
    result["ratios"] = _ratios(modes)


def _largest_share(spec: allocator.JobSpec, gpus: int) -> int:
    return max(allocator.min_share(spec), allocator.max_share(spec, gpus))


def demand_rate(view: Workload, spec: allocator.JobSpec, gpus: int) -> float:
    """A job's demand: its single-job ideal rate alone on its largest share (max_gpus, or the pool)."""
    return fluid.ideal_rate(pool.on_gpus(view, _largest_share(spec, gpus)))


def ideal_report(wl: Workload, specs: dict[str, allocator.JobSpec]) -> dict:
    """The ``ideal`` entry: the makespan bound, the total rate it allows, and W_j and T_j per job.

    Two bounds, both makespans no allocation beats; ``ideal`` is the later:

    - ``work_bound_s``: max(sum W_j / gpus, max T_j), the benchmark spec's
      closed form, which charges the learner at its one-GPU rate;
    - ``split_bound_s``: the best split of the pool among the jobs and
      their stages, each job holding at least its minimum while it runs and
      its learner at its real scaling (``fluid.split_makespan``).
    """
    views, g = pool.job_views(wl), wl.cluster.gpus
    work = {j: fluid.job_work_gpu_s(v, _largest_share(specs[j], g)) for j, v in views.items()}
    n = {j: v.job.steps * v.job.batch_size for j, v in views.items()}
    alone = {j: n[j] / demand_rate(views[j], specs[j], g) for j in views}
    work_bound = fluid.ideal_makespan(list(work.values()), list(alone.values()), g)
    # A split of the stages is no bound when the learner scales better than linearly: taking turns beats it.
    split_bound = (fluid.split_makespan(list(views.values()), [allocator.min_share(specs[j]) for j in views],
                                        [_largest_share(specs[j], g) for j in views], g)
                   if wl.learner.scaling_exponent <= 1 else 0.0)
    makespan = max(work_bound, split_bound)
    return {"trajectories_per_s": sum(n.values()) / makespan, "makespan_s": makespan,
            "work_bound_s": work_bound, "split_bound_s": split_bound,
            "jobs": {j: {"work_gpu_s": work[j], "alone_s": alone[j]} for j in views}}


def jain_index(xs: list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has everything."""
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if sq > 0 else 1.0


def pool_report(r: PoolResult, demand: dict[str, float]) -> dict:
    """A simulated mode's entry: the pool's figures and, under ``jobs``, each job's."""
    jobs = {}
    for j, m in r.jobs.items():
        jobs[j] = {"trajectories_per_s": m.trajectories_per_s, "finish_s": m.sim_time_s,
                   "below_min_gpu_s": r.below_min_gpu_s[j], "relative_to_demand": m.trajectories_per_s / demand[j],
                   **{k: v for k, v in m.report().items() if k not in ("trajectories_per_s", "gpu_busy_frac")}}
    return {"trajectories_per_s": r.trajectories_per_s, "makespan_s": r.makespan_s,
            "gpu_busy_frac": r.gpu_busy_frac, "below_min_gpu_s": sum(r.below_min_gpu_s.values()),
            "jain_fairness": jain_index([v["relative_to_demand"] for v in jobs.values()]),
            "moved_between_jobs": r.moved_between_jobs, "jobs": jobs}


def _ratios(modes: dict[str, dict]) -> dict[str, float]:
    if "libra" not in modes:
        return {}
    lib = modes["libra"]["trajectories_per_s"]
    return {f"libra/{b}": lib / modes[b]["trajectories_per_s"] for b in ("static", "ideal") if b in modes}


# --- terminal table -----------------------------------------------------------

_POOL_COLUMNS = (("mode", "{}", "mode"), ("traj/s", "{:.2f}", "trajectories_per_s"),
                 ("makespan s", "{:.0f}", "makespan_s"), ("gpu busy", "{:.1%}", "gpu_busy_frac"),
                 ("below min GPU-s", "{:.0f}", "below_min_gpu_s"), ("jain", "{:.3f}", "jain_fairness"),
                 ("moved", "{:d}", "moved_between_jobs"))
_JOB_COLUMNS = (("mode", "{}", "mode"), ("job", "{}", "job"), ("traj/s", "{:.2f}", "trajectories_per_s"),
                ("finish s", "{:.0f}", "finish_s"), ("below min GPU-s", "{:.0f}", "below_min_gpu_s"),
                ("rel. demand", "{:.3f}", "relative_to_demand"), ("learner wait", "{:.1%}", "learner_wait_frac"),
                ("stale p50", "{:.0f}", "staleness_p50"), ("stale p99", "{:.0f}", "staleness_p99"),
                ("dropped", "{:d}", "dropped_stale"), ("reconfigs", "{:d}", "reconfigurations"),
                ("final allocation", "{}", "final_allocation"))


def _table(columns, rows: list[dict]) -> list[str]:
    """Fixed-width lines: a header, a rule, then one line per row ('-' where a value is absent)."""
    cells = [[c[0] for c in columns]]
    for row in rows:
        out = []
        for _, fmt, key in columns:
            v = row.get(key)
            if key == "final_allocation" and v is not None:
                v = " ".join(f"{k}={n}" for k, n in v.items() if n)
            out.append("-" if v is None else fmt.format(v))
        cells.append(out)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    text = ["  ".join(c.ljust(w) if columns[j][1] == "{}" else c.rjust(w)    # text left, figures right
                      for j, (c, w) in enumerate(zip(r, widths))).rstrip() for r in cells]
    return text[:1] + ["  ".join("-" * w for w in widths)] + text[1:]


def format_pool_table(result: dict) -> str:
    """The pool's rows (one per mode), each job's rows, the ideal bound's W_j and T_j, then the ratios."""
    modes = result["modes"]
    lines = [f"workload {result['workload']}: {len(result['jobs'])} jobs on one pool "
             "(trajectories per simulated second, simulated seconds)"]
    lines += _table(_POOL_COLUMNS, [{"mode": m, **v} for m, v in modes.items()])
    job_rows = [{"mode": m, "job": j, **jv} for m, v in modes.items() if m != "ideal" for j, jv in v["jobs"].items()]
    if job_rows:
        lines += [""] + _table(_JOB_COLUMNS, job_rows)
    if "ideal" in modes:
        ideal = modes["ideal"]
        lines += ["", f"ideal: makespan {ideal['makespan_s']:.0f} s, the later of the best split of the pool "
                      f"({ideal['split_bound_s']:.0f} s) and the work bound ({ideal['work_bound_s']:.0f} s: "
                      + "  ".join(f"{j} W={v['work_gpu_s']:.0f} GPU-s T={v['alone_s']:.0f} s"
                                  for j, v in ideal["jobs"].items()) + ")"]
    if result.get("not_applicable"):
        lines += ["", "not applicable to multi-job workloads: " + ", ".join(result["not_applicable"])]
    if result["ratios"]:
        lines += ["", "  ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items())]
    return "\n".join(lines + live_summary(result))


# --- plot ---------------------------------------------------------------------

def draw_pool(result: dict, ax_a, ax_r) -> None:
    """GPUs ordered to each job (``ax_a``) and each job's throughput per learner step (``ax_r``), over time.

    One colour per job, one line style per mode; ``bench_allocator.plot`` makes
    the figure and saves it (matplotlib is optional).
    """
    colour = {j: f"C{i}" for i, j in enumerate(result["jobs"])}
    styles = {"static": ":", "libra": "-"}
    for mode, d in result.get("details", {}).items():
        if mode not in styles:
            continue
        end = d["sim_time_s"]
        for job in result["jobs"]:
            pts = [(s["t"], s["shares"].get(job, 0)) for s in d["shares"]] + [(end, 0)]
            ax_a.step([t for t, _ in pts], [n for _, n in pts], where="post", color=colour[job], ls=styles[mode],
                      label=f"{mode} {job}")
            tl = d["timelines"][job]
            ax_r.plot([p["t"] for p in tl], [p["rate"] for p in tl], color=colour[job], ls=styles[mode], lw=1,
                      label=f"{mode} {job}")
    ax_a.set_ylabel("GPUs ordered")
    ax_a.set_title(f"workload {result['workload']}: each job's GPUs and throughput")
