"""``libra-ctl bench policy --sweep N --seed S``: the policy on N random workloads.

Called by ``pipeline.sim.bench_allocator`` (the ``policy`` command, in the CLI
process), which hands ``run_sweep`` its own runner of one workload
(``bench_allocator.run_workload``) so that this module needs nothing from it.
Workload i of seed S is ``workload_gen.random_workload(default_rng([S, i]))``:
it does not depend on N, and the same seed gives the same workloads and, the
des engine being deterministic, the same figures. The sweep reports the
distribution of libra/ideal over the workloads (the minimum is what counts),
the trajectories dropped as stale as a share of those trained, and the worst
workloads with their key features. Each workload's stale floor
(``fluid.stale_floor``: the share that goes stale at the ideal pace under any
allocation) splits the sweep in two: where it passes the drop budget
(``control.stale_drop_budget``), 0.95 of ideal and that budget exclude each
other, so libra/ideal is also given over the workloads whose floor is within
it. ``save_min`` writes the minimum's workload as TOML, and the minimum of
those within the budget beside it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ControlConfig
from pipeline.sim import fluid
from pipeline.sim.workload import Workload, parse_workload
from pipeline.sim.workload_gen import GPUS, random_workload, to_toml

# libra/ideal needs these two; static (one more des run each) shows how much of a gap the policy closes.
SWEEP_MODES = ("static", "libra", "ideal")
REQUIRED = ("libra", "ideal")
SHOW_WORST = 5
MIN_FILE = "sweep-min.toml"
MIN_OK_FILE = "sweep-min-floor-ok.toml"    # the minimum over the workloads whose stale floor allows the aims
DROP_BUDGET = ControlConfig().stale_drop_budget   # share of trained trajectories the aims allow to drop
FLOOR_KEY = "stale floor %"

Report = Callable[[str], None]
RunOne = Callable[[Workload, list[str], Report], dict]   # bench_allocator.run_workload's shape


def workload_at(seed: int, index: int, gpus: tuple[int, int] = GPUS) -> dict[str, Any]:
    """Workload ``index`` of the sweep of ``seed`` (clusters of ``gpus`` GPUs), as a TOML-able dict."""
    return random_workload(np.random.default_rng([seed, index]), f"sweep-s{seed}-{index:03d}", gpus)


def run_sweep(n: int, seed: int, modes: list[str], run_one: RunOne, report: Report | None = None,
              gpus: tuple[int, int] = GPUS) -> dict:
    """Generate and run ``n`` workloads; returns {"sweep", "distribution", "workloads", "worst"}.

    ``modes`` must include libra and ideal (``check_modes``); ``run_one(wl,
    modes, report)`` runs one workload and returns run_bench's result shape.
    ``report`` gets one progress line per workload.
    """
    say = report or (lambda line: None)
    rows = []
    for i in range(n):
        data = workload_at(seed, i, gpus)
        wl = parse_workload(data, data["name"])
        t0 = time.perf_counter()
        res = run_one(wl, modes, lambda line: None)
        rows.append(_row(i, wl, res, time.perf_counter() - t0))
        say(_progress_line(n, rows[-1]))
    worst = sorted(range(n), key=lambda k: rows[k]["libra/ideal"])[:SHOW_WORST]
    return {"sweep": {"n": n, "seed": seed, "gpus": list(gpus), "modes": list(modes)},
            "distribution": _distribution(rows), "workloads": rows, "worst": worst}


def check_modes(modes: list[str]) -> None:
    """A sweep measures libra/ideal: raise ValueError naming what is missing."""
    missing = [m for m in REQUIRED if m not in modes]
    if missing:
        raise ValueError(f"--sweep needs the modes {','.join(REQUIRED)} (missing {','.join(missing)}); "
                         f"the default is {','.join(SWEEP_MODES)}")


def _row(i: int, wl: Workload, res: dict, wall_s: float) -> dict:
    """One workload's figures: ratios to ideal, drops as a % of trained, features, and its modes."""
    trained = wl.job.steps * wl.job.batch_size
    ideal = res["modes"]["ideal"]["trajectories_per_s"]
    row = {"index": i, "name": wl.name, "features": features(wl), "wall_s": round(wall_s, 2)}
    for mode, m in res["modes"].items():
        if mode != "ideal":
            row[f"{mode}/ideal"] = m["trajectories_per_s"] / ideal
        if m.get("dropped_stale") is not None:
            row[f"{mode} dropped %"] = 100.0 * m["dropped_stale"] / trained
    floor = res.get("details", {}).get("ideal", {}).get("stale_floor")
    if floor is not None:
        row[FLOOR_KEY] = 100.0 * floor["fraction"]
    row.update(modes=res["modes"], ratios=res["ratios"])
    return row


def features(wl: Workload) -> dict:
    """What sets a workload apart, in plain numbers (printed for the worst ones, kept in --json)."""
    job, phases = wl.job, wl.job.phases
    return {"gpus": wl.cluster.gpus,
            "reward": (f"gpu {wl.reward.seconds:g} s" if wl.reward.gpu
                       else f"cpu {wl.reward.cpu_workers} x {wl.reward.seconds:g} s"),
            "phases": len(phases), "steps": job.steps, "batch": job.batch_size, "group": job.group_size,
            "max_staleness": job.max_staleness, "concurrency": wl.rollout.concurrency,
            "response_median": [ph.response_tokens.median for ph in phases],
            "response_p99_x": [round(ph.response_tokens.p99 / ph.response_tokens.median, 1) for ph in phases],
            "tool_calls": [ph.tool_calls.per_trajectory for ph in phases],
            "ideal_learner_share": [round(_learner_share(wl, ph), 2) for ph in phases],
            "cpu_reward_bound": [bool(fluid.cpu_reward_cap(wl, ph) <= fluid.ideal_phase_rate(wl, ph))
                                 for ph in phases],
            "switch_cost_s": wl.cluster.switch_cost_s,
            "scaling_exponent": wl.learner.scaling_exponent}


def _learner_share(wl: Workload, ph) -> float:
    """Share of the pool the learner holds in the phase's ideal split."""
    c, le = fluid.phase_cost(wl, ph), wl.learner
    rate = fluid.ideal_phase_rate(wl, ph)
    return (rate * c.tokens / le.train_tokens_per_s) ** (1 / le.scaling_exponent) / wl.cluster.gpus


def _distribution(rows: list[dict]) -> dict:
    """min, p10, median and max of each ratio to ideal and of libra over each other mode; median, p90 and
    max of each drop share and of the stale floor.

    With the floors known, libra/ideal again over the workloads whose floor is
    within the drop budget (key ``libra/ideal, floor ok``, with their count ``n``).
    """
    out = {}
    for key in [k for k in rows[0] if k.endswith(("/ideal", "%"))]:
        vals = np.array([r[key] for r in rows], dtype=float)
        out[key] = _ratio_quantiles(vals) if key.endswith("/ideal") else \
            {"median": np.median(vals), "p90": np.percentile(vals, 90), "max": vals.max()}
    for key in [k for k in rows[0]["ratios"] if k.startswith("libra/") and not k.endswith("/ideal")]:
        out[key] = _ratio_quantiles(np.array([r["ratios"][key] for r in rows], dtype=float))
    if FLOOR_KEY in rows[0]:
        ok = np.array([r["libra/ideal"] for r in rows if _floor_ok(r)], dtype=float)
        if ok.size:
            out["libra/ideal, floor ok"] = {"n": ok.size, **_ratio_quantiles(ok)}
    return {k: {q: float(v) for q, v in d.items()} for k, d in out.items()}


def _floor_ok(row: dict) -> bool:
    """Whether the workload's stale floor is known and within the drop budget (the aims can both hold)."""
    return row.get(FLOOR_KEY, math.inf) <= 100.0 * DROP_BUDGET


def _ratio_quantiles(vals: np.ndarray) -> dict:
    return {"min": vals.min(), "p10": np.percentile(vals, 10), "median": np.median(vals), "max": vals.max()}


def _progress_line(n: int, row: dict) -> str:
    f = row["features"]
    figures = [f"libra/ideal {row['libra/ideal']:.3f}"]
    figures += [f"{k} {row[k]:.3f}" for k in row if k.endswith("/ideal") and k != "libra/ideal"]
    figures.append(f"libra dropped {row['libra dropped %']:.1f}%")
    return (f"sweep {row['index'] + 1}/{n} {row['name']}: {f['gpus']} GPUs, reward {f['reward']}, "
            f"{f['phases']} phase(s): {'  '.join(figures)} ({row['wall_s']:.1f} s wall)")


def format_sweep(result: dict) -> str:
    """The distribution and the worst workloads, for the terminal."""
    sw, dist = result["sweep"], result["distribution"]
    lines = [f"sweep of {sw['n']} random workloads of {sw['gpus'][0]}-{sw['gpus'][1]} GPUs, seed {sw['seed']}, "
             f"modes {','.join(sw['modes'])} (libra/ideal: trajectories per simulated second over the bound)", ""]
    for key, d in dist.items():
        pct = "%" if key.endswith("%") else ""
        label = key if key != "libra/ideal, floor ok" else \
            f"libra/ideal on the {d['n']:.0f} with a stale floor <= {DROP_BUDGET:.1%}\n{'':<20}"
        lines.append(f"{label:<20} " + "  ".join(f"{q} {v:.3f}{pct}" if not pct else f"{q} {v:.2f}{pct}"
                                                for q, v in d.items() if q != "n"))
    lines += ["", f"worst {len(result['worst'])} by libra/ideal:"]
    for k in result["worst"]:
        row = result["workloads"][k]
        lines.append(f"  {row['name']}  libra/ideal {row['libra/ideal']:.3f}"
                     + (f"  static/ideal {row['static/ideal']:.3f}" if "static/ideal" in row else "")
                     + f"  libra dropped {row['libra dropped %']:.1f}%"
                     + (f"  stale floor {row[FLOOR_KEY]:.1f}%" if FLOOR_KEY in row else ""))
        lines.append("    " + _feature_line(row["features"]))
    return "\n".join(lines)


def _feature_line(f: dict) -> str:
    def arrow(xs):
        return "→".join(f"{x:g}" for x in xs)
    cpu_bound = [i + 1 for i, b in enumerate(f["cpu_reward_bound"]) if b]
    return (f"{f['gpus']} GPUs x {f['concurrency']} slots, reward {f['reward']}, batch {f['batch']} "
            f"(groups of {f['group']}), staleness ≤ {f['max_staleness']}, {f['steps']} steps, "
            f"switch {f['switch_cost_s']:g} s; response median {arrow(f['response_median'])} "
            f"(p99 x{arrow(f['response_p99_x'])}), tools {arrow(f['tool_calls'])}/traj, "
            f"ideal learner share {arrow(f['ideal_learner_share'])}"
            + (f"; CPU reward bounds phase {','.join(map(str, cpu_bound))}" if cpu_bound else ""))


def save_min(result: dict, directory: str | Path) -> list[Path]:
    """Write the minimum's workload to ``directory``/sweep-min.toml, with how it was generated on top.

    When the floors are known and some workloads' floor is over the drop budget, the minimum of those
    within it goes to ``directory``/sweep-min-floor-ok.toml too. Returns the paths written.
    """
    rows = result["workloads"]
    worst = rows[result["worst"][0]]
    paths = [_save(result, worst, directory, MIN_FILE)]
    ok = [r for r in rows if _floor_ok(r)]
    if ok and len(ok) < len(rows):
        best_case = min(ok, key=lambda r: r["libra/ideal"])
        paths.append(_save(result, best_case, directory, MIN_OK_FILE,
                           f" over the workloads whose stale floor is <= {DROP_BUDGET:.1%}\n"
                           f"(this one's: {best_case[FLOOR_KEY]:.2f}%)"))
    return paths


def _save(result: dict, row: dict, directory: str | Path, name: str, among: str = "") -> Path:
    sw = result["sweep"]
    gpus = tuple(sw["gpus"])
    narrowed = "" if gpus == GPUS else f", {gpus}"
    flag = "" if gpus == GPUS else f" --sweep-gpus {gpus[0]} {gpus[1]}"
    comment = (f"The minimum of libra/ideal ({row['libra/ideal']:.3f}){among} in the sweep of {sw['n']} random "
               f"workloads,\n"
               f"seed {sw['seed']}: workload index {row['index']}, made by\n"
               f"pipeline.sim.workload_gen.random_workload(numpy.random.default_rng([{sw['seed']}, {row['index']}]), "
               f"{row['name']!r}{narrowed})\n"
               f"(libra-ctl bench policy --sweep {sw['n']} --seed {sw['seed']}{flag} --save-worst; "
               f"modes {','.join(sw['modes'])}).")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    path = path / name
    path.write_text(to_toml(workload_at(sw["seed"], row["index"], gpus), comment))
    return path
