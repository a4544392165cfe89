"""Figures of finished runs, their spread over seeds, and the field guide's verdict: pure functions.

``libra-ctl baseline`` and ``libra-ctl experiment`` (``pipeline.experiment``)
read each run's ``summary.json`` and ``metrics.jsonl`` and hand them here.
``run_figures`` turns one run into the four metric kinds (throughput,
resources, queues, training quality) and its held-out and reward curves;
``spread`` summarises a figure over seeds; ``time_to_target`` interpolates
along a held-out curve; ``noise`` and ``is_noisy`` say whether an
environment is too noisy to tune on; ``verdict`` judges a value against the
baseline (time down, fluctuation down, reward and success no worse);
``spread_table`` and ``comparison_table`` lay it out, ``render_text`` and
``render_markdown`` print it. No files, processes or Redis: the tests feed
plain data.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

FINAL_STEPS = 5            # learner steps whose reward is the run's final reward (one step is one noisy batch)
NO_WORSE_FLOOR = 0.01      # the smallest drop in reward or success that counts as worse, whatever the noise
DEFAULT_EFFECT = 0.05      # absolute held-out success an experiment hopes to detect


@dataclass(frozen=True)
class Metric:
    key: str
    kind: str      # throughput, resources, queues, quality; "totals" for wall time and trajectories
    label: str
    fmt: str       # format of one value


METRICS = (
    Metric("trajectories_per_s", "throughput", "trajectories/s trained", "{:.2f}"),
    Metric("slot_busy", "resources", "slot busy fraction", "{:.1%}"),
    Metric("slot_busy_sd", "resources", "slot busy fluctuation (sd over time)", "{:.1%}"),
    Metric("gpu_util", "resources", "GPU utilisation (%)", "{:.1f}"),
    Metric("gpu_util_sd", "resources", "GPU utilisation fluctuation (sd over time)", "{:.1f}"),
    Metric("learner_queue", "queues", "learner queue (groups, mean)", "{:.2f}"),
    Metric("reward_queue", "queues", "reward queue (groups, mean)", "{:.2f}"),
    Metric("learner_wait", "queues", "learner wait ratio", "{:.1%}"),
    Metric("success_final", "quality", "final held-out success", "{:.1%}"),
    Metric("reward_final", "quality", f"final reward mean (last {FINAL_STEPS} steps)", "{:.3f}"),
    Metric("diversity", "quality", "distinct rate (diversity)", "{:.2f}"),
    Metric("wall_s", "totals", "wall time (s)", "{:.0f}"),
    Metric("trajectories", "totals", "trajectories consumed (trained + dropped stale)", "{:.0f}"),
)
BY_KEY = {m.key: m for m in METRICS}


# --- one run --------------------------------------------------------------------------------------------


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _consumed(step: dict) -> int:
    return int(step.get("trained_total", 0)) + int(step.get("dropped_stale_total", 0))


def run_clock(t0: float, resumes: list[float], ats: list[float]) -> Callable[[float], float]:
    """Seconds a run had been running at wall time ``at``: since its first start ``t0``, less the time it lay
    stopped before each resume (from the last thing it recorded before a resume, ``ats``, to the resume)."""
    gaps, prev = [], [t0]
    for back in sorted(resumes):
        # from the last thing recorded before it, or the resume before it (a process that recorded nothing)
        last = max([a for a in (*ats, *prev) if a < back], default=back)
        gaps.append((back, back - last))
        prev.append(back)
    return lambda at: at - t0 - sum(g for back, g in gaps if at >= back)


def _as_clock(t0: float | Callable[[float], float]) -> Callable[[float], float]:
    return t0 if callable(t0) else (lambda at: at - t0)


def eval_curve(evals: list[dict], steps: list[dict], t0: float | Callable[[float], float]) -> list[dict]:
    """Held-out success on a time axis and a trajectories axis, one point per evaluated version.

    A version is placed where the learner step that produced it was
    recorded (its ``at``, ``trained_total + dropped_stale_total``): the policy
    had reached that success then, whenever the evaluation finished. Version 0
    is the start (0 s, 0 trajectories). A version no step line produced is left
    out; of two evaluations of one version (a periodic and the final) the first
    is kept. ``t0``: the run's start, or its clock (``run_clock``).
    """
    clock = _as_clock(t0)
    by_version = sorted(steps, key=lambda s: s.get("policy_version", 0))
    points, seen = [], set()
    for e in sorted(evals, key=lambda e: e["version"]):
        v = e["version"]
        if v in seen or e.get("n") == 0:   # an evaluation that judged no episode has no success to plot
            continue
        if v == 0:
            t, n = 0.0, 0
        else:
            made = next((s for s in by_version if s.get("policy_version", 0) >= v and "at" in s), None)
            if made is None:
                continue
            t, n = clock(made["at"]), _consumed(made)
        seen.add(v)
        points.append({"version": v, "success": e["success_rate"], "t_s": round(t, 3), "trajectories": n})
    return points


def standing_steps(steps: list[dict]) -> list[dict]:
    """Each learner step's record that stands, by step: a step a restored learner trained again is logged
    twice, and its later record (the resumed learner's) replaces the dead one's."""
    return sorted({s["step"]: s for s in steps}.values(), key=lambda s: s["step"])


def reward_curve(steps: list[dict], t0: float | Callable[[float], float]) -> list[dict]:
    clock = _as_clock(t0)
    return [{"step": s["step"], "t_s": round(clock(s["at"]), 3), "trajectories": _consumed(s),
             "reward": s.get("reward_mean")} for s in standing_steps(steps) if "at" in s]


def training_window(samples: list[dict]) -> list[dict]:
    """The samples taken while the job trained (phase ``running``) and the one that closes that phase.

    Workers report a call's cost when it ends, so the calls that end the
    training reach the first sample taken after it: in a short run that can
    be all of them (a 2-step run measured a slot busy share of 0 over its
    running samples on a loaded machine). No sample ran: all of them.
    """
    idx = [i for i, s in enumerate(samples) if s.get("phase") == "running"]
    if not idx:
        return samples
    return [s for i, s in enumerate(samples) if s.get("phase") == "running" or i == idx[-1] + 1]


def _slot_busy(sample: dict) -> dict:
    return (sample.get("resources") or {}).get("slot_busy") or {}


def run_figures(summary: dict, steps: list[dict], samples: list[dict]) -> dict:
    """One finished run as the figures of the four kinds, its totals and its two curves.

    ``summary``: the run's ``summary.json``; ``steps`` and ``samples``: its
    ``learner_step`` and ``sample`` lines of ``metrics.jsonl``. Resources and
    queues come from the samples taken while the job trained (phase
    ``running``); ``slot_busy`` (over the ``training_window``, which adds the
    sample that closes the phase) is slot-seconds busy over slot-seconds held,
    ``slot_busy_sd`` the standard deviation of the samples' busy share over
    time (the field guide's "fluctuation"). A figure the run did not record
    is None.
    """
    # the run's first start; a resume's summary written before runs kept their first start named the resume's,
    # and nothing the run recorded may come before its t0
    ats = [s["at"] for s in steps + samples + (summary.get("evals") or []) if s.get("at")]
    t0 = min([x for x in (summary.get("started_at"), *ats) if x], default=0.0)
    # a resumed run is timed as if it had run at once: the time it lay stopped is left out
    resumes = summary.get("resumes") or ([summary["resumed_at"]] if summary.get("resumed_at") else [])
    clock = run_clock(t0, resumes, ats)
    wall = summary.get("wall_s")
    if resumes and wall is not None:   # the last process's wall, after what the run had done before it
        wall = round(clock(max(resumes)) + wall, 1)
    steps = standing_steps(steps)
    running = [s for s in samples if s.get("phase") == "running"] or samples
    busy = [_slot_busy(s) for s in training_window(samples)]
    fracs = [b["frac"] for b in map(_slot_busy, running) if b.get("frac") is not None]
    slot_s = sum(b.get("slot_s", 0.0) for b in busy)
    gpu = [_mean(g.get("util_percent") for g in (s.get("resources") or {}).get("gpus") or []) for s in running]
    gpu = [g for g in gpu if g is not None]
    queues = [s.get("queues") or {} for s in running]
    wait, train = sum(s.get("wait_s", 0.0) for s in steps), sum(s.get("train_s", 0.0) for s in steps)
    last = steps[-FINAL_STEPS:]
    weights = sum(s.get("trajectories", 0) for s in last)
    div = next((s["diversity_distinct_rate"] for s in reversed(steps)
                if s.get("diversity_distinct_rate") is not None), None)
    trained, dropped = summary.get("trajectories_trained", 0), summary.get("dropped_stale", 0)
    tps = summary.get("trajectories_per_s")   # the last process's: after a resume, what it trained over its wall
    if resumes and wall:
        tps = round(trained / wall, 2)   # the whole run's, over the same clock as its wall_s
    return {
        "trajectories_per_s": tps,
        "slot_busy": sum(b.get("busy_s", 0.0) for b in busy) / slot_s if slot_s > 0 else None,
        "slot_busy_sd": statistics.pstdev(fracs) if len(fracs) >= 2 else None,
        "gpu_util": _mean(gpu), "gpu_util_sd": statistics.pstdev(gpu) if len(gpu) >= 2 else None,
        "learner_queue": _mean(q.get("learner_queue") for q in queues),
        "reward_queue": _mean(q.get("reward_queue") for q in queues),
        "learner_wait": (wait / (wait + train) if wait + train > 0
                         else _mean(q.get("learner_wait_ratio") for q in queues)),
        # an evaluation that judged no episode (eval_prompts 0) has no success: None, never a 0%
        "success_start": None if summary.get("eval_prompts_start") == 0 else summary.get("success_rate_start"),
        "success_final": None if summary.get("eval_prompts") == 0 else summary.get("success_rate_end"),
        "reward_final": (sum(s.get("reward_mean", 0.0) * s.get("trajectories", 0) for s in last) / weights
                         if weights else _mean(s.get("reward_mean") for s in last)),
        "diversity": div,
        "wall_s": wall, "trajectories": trained + dropped,
        "trained": trained, "dropped_stale": dropped, "steps": summary.get("steps"),
        "curve": eval_curve(summary.get("evals") or [], steps, clock),
        "reward_curve": reward_curve(steps, clock),
    }


def time_to_target(curve: list[dict], target: float, axis: str = "t_s") -> float | None:
    """Where the held-out curve first reaches ``target``, linearly interpolated on ``axis``; None if never.

    ``axis``: ``t_s`` (seconds since the run's start) or ``trajectories``
    (consumed). A curve already at the target at its first point reaches it there.
    """
    prev = None
    for p in curve:
        if p["success"] >= target:
            if prev is None:
                return float(p[axis])
            share = (target - prev["success"]) / (p["success"] - prev["success"])
            return prev[axis] + share * (p[axis] - prev[axis])
        prev = p
    return None


def with_target(figures: dict, target: float) -> dict:
    """The run's figures with its time and trajectories to ``target`` held-out success."""
    curve = figures.get("curve") or []
    t = time_to_target(curve, target, "t_s")
    # a run that never reached the target took at least its whole time: a lower bound on its time (its curve's
    # last point where that is later: a resumed run recorded before resumes were counted has its last process's
    # wall_s)
    spent = max([x for x in (figures.get("wall_s"), *(p.get("t_s") for p in curve)) if x is not None], default=None)
    return {**figures, "time_to_target_s": t, "trajectories_to_target": time_to_target(curve, target, "trajectories"),
            "time_to_target_bound_s": t if t is not None else spent}


# --- over seeds -----------------------------------------------------------------------------------------


def spread(values) -> dict:
    """Mean, sample standard deviation, min and max of the values that are not None (sd None below 2)."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(vals) / len(vals), "sd": statistics.stdev(vals) if len(vals) >= 2 else None,
            "min": min(vals), "max": max(vals), "n": len(vals)}


def noise(values) -> float | None:
    """The seed-to-seed spread of a figure: sd from 3 seeds on, half the range with 2, None with fewer."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if len(vals) >= 3:
        return statistics.stdev(vals)
    if len(vals) == 2:
        return abs(vals[0] - vals[1]) / 2
    return None


def is_noisy(values, effect: float = DEFAULT_EFFECT) -> bool | None:
    """Whether seeds disagree by more than the effect one hopes to detect; None when one seed cannot tell."""
    n = noise(values)
    return None if n is None else n > effect


TARGET_KEYS = ("time_to_target_s", "trajectories_to_target", "time_to_target_bound_s")


def aggregate(runs: list[dict]) -> dict:
    """Every figure's spread over the runs that finished (``ok``), and how many reached the target."""
    ok = [r for r in runs if r.get("ok", True)]
    out = {m.key: spread(r.get(m.key) for r in ok) for m in METRICS}
    out["success_start"] = spread(r.get("success_start") for r in ok)
    for k in TARGET_KEYS:
        out[k] = spread(r.get(k) for r in ok)
    out["runs"], out["ok"] = len(runs), len(ok)
    out["reached"] = sum(1 for r in ok if r.get("time_to_target_s") is not None)
    return out


# --- the verdict ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Criterion:
    name: str
    ok: bool | None      # None: cannot tell (nothing measured, or neither reached the target)
    detail: str


def _pct(a: float, b: float) -> str:
    return f" ({(a - b) / b:+.0%})" if b else ""


def time_down(base: dict, cand: dict) -> Criterion:
    """Time to the target: fewer wall seconds, reaching it in no smaller share of the runs.

    With equal shares, the means over the runs that reached it are compared.
    When the candidate reaches it in more runs, the runs that never reached
    it count with their whole wall time, a lower bound on their time that
    favours whichever side reached it less often: the candidate's time is
    down when its mean is below the baseline's even so, and cannot be told
    otherwise (comparing only the runs that reached it would drop the
    baseline's failures).
    """
    b, c = base["time_to_target_s"], cand["time_to_target_s"]
    b_share = base["reached"] / base["ok"] if base["ok"] else 0.0
    c_share = cand["reached"] / cand["ok"] if cand["ok"] else 0.0
    reach = f"reached in {cand['reached']}/{cand['ok']} runs, baseline {base['reached']}/{base['ok']}"
    if not cand["reached"] and not base["reached"]:
        return Criterion("time down", None, "neither reached the target")
    if c_share < b_share:
        return Criterion("time down", False, reach)
    if not base["reached"]:
        return Criterion("time down", True, reach)
    if c_share > b_share:
        cb, bb = cand["time_to_target_bound_s"]["mean"], base["time_to_target_bound_s"]["mean"]
        if cb is None or bb is None:
            return Criterion("time down", None, reach)
        return Criterion("time down", True if cb < bb else None,
                         f"{cb:.0f} s vs at least {bb:.0f} s, counting a run that never reached the target at its "
                         f"wall time; {reach}")
    ok = c["mean"] < b["mean"]
    return Criterion("time down", ok, f"{c['mean']:.0f} s vs {b['mean']:.0f} s{_pct(c['mean'], b['mean'])}"
                     + ("" if c_share == b_share == 1 else f"; {reach}"))


def fluctuation_down(base: dict, cand: dict) -> Criterion:
    b, c = base["slot_busy_sd"]["mean"], cand["slot_busy_sd"]["mean"]
    if b is None or c is None:
        return Criterion("fluctuation down", None, "slot busy share not sampled (metrics.interval_s too long?)")
    return Criterion("fluctuation down", c < b, f"sd of slot busy over time {c:.1%} vs {b:.1%}")


def no_worse(base: dict, cand: dict, key: str, name: str, floor: float = NO_WORSE_FLOOR) -> Criterion:
    """No worse within the baseline's noise: mean difference > -max(2 sd_baseline / sqrt(K), floor)."""
    b, c = base[key], cand[key]
    if b["mean"] is None or c["mean"] is None:
        return Criterion(name, None, "not measured")
    tol = max(2 * b["sd"] / math.sqrt(max(c["n"], 1)), floor) if b["sd"] is not None else floor
    diff = c["mean"] - b["mean"]
    fmt = BY_KEY[key].fmt
    return Criterion(name, diff > -tol, f"{fmt.format(c['mean'])} vs {fmt.format(b['mean'])} "
                                        f"(difference {diff:+.3f}, tolerance {tol:.3f})")


def verdict(base: dict, cand: dict) -> dict:
    """The field guide's test of a value against the baseline, on two aggregates (``aggregate``).

    ``better`` when time to the target and slot-busy fluctuation both go down
    and final reward and held-out success are no worse; ``not better`` when a
    criterion fails; ``inconclusive`` when none fails but one cannot be told.
    """
    if not cand["ok"]:
        return {"outcome": "failed", "criteria": [], "summary": "failed (no run finished)"}
    if not base["ok"]:
        return {"outcome": "no baseline", "criteria": [], "summary": "no baseline (no baseline run finished)"}
    crits = [time_down(base, cand), fluctuation_down(base, cand),
             no_worse(base, cand, "reward_final", "reward no worse"),
             no_worse(base, cand, "success_final", "success no worse")]
    failed = [c.name for c in crits if c.ok is False]
    unknown = [c.name for c in crits if c.ok is None]
    outcome = "not better" if failed else "inconclusive" if unknown else "better"
    why = ", ".join(f"not {n}" for n in failed) or ", ".join(f"{n}: unknown" for n in unknown)
    return {"outcome": outcome, "summary": outcome + (f" ({why})" if why else ""),
            "criteria": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in crits]}


# --- tables ---------------------------------------------------------------------------------------------


def fmt_spread(s: dict, fmt: str) -> str:
    """``mean ± sd`` (sd over seeds), ``mean`` for one seed, ``-`` when nothing was measured."""
    if s["mean"] is None:
        return "-"
    return fmt.format(s["mean"]) + (f" ± {fmt.format(s['sd'])}" if s["sd"] is not None else "")


def spread_table(agg: dict, kinds=("throughput", "resources", "queues", "quality", "totals")) -> tuple[list, list]:
    """(header, rows): one row per figure the runs recorded, with mean, sd, min and max over seeds."""
    header = ["kind", "figure", "mean", "sd", "min", "max", "seeds"]
    rows = []
    for m in METRICS:
        s = agg[m.key]
        if m.kind not in kinds or s["mean"] is None:
            continue
        cell = lambda v: "-" if v is None else m.fmt.format(v)
        rows.append([m.kind, m.label, cell(s["mean"]), cell(s["sd"]), cell(s["min"]), cell(s["max"]), str(s["n"])])
    return header, rows


COMPARISON = (   # (column, figure) of the experiment table, after the value, runs and time-to-target columns:
    # the four kinds, with the field guide's final check (throughput, reward and diversity) among them
    ("trajectories/s", "trajectories_per_s"), ("slot busy", "slot_busy"), ("busy fluctuation", "slot_busy_sd"),
    ("learner queue", "learner_queue"), ("reward queue", "reward_queue"), ("learner wait", "learner_wait"),
    ("final reward", "reward_final"), ("final success", "success_final"), ("distinct rate", "diversity"),
    ("wall s", "wall_s"), ("trajectories", "trajectories"),
)


def _to_target(agg: dict, key: str, fmt: str) -> str:
    if not agg["ok"]:
        return "-"
    if not agg["reached"]:
        return "never"
    cell = fmt_spread(agg[key], fmt)
    return cell if agg["reached"] == agg["ok"] else f"{cell} ({agg['reached']}/{agg['ok']})"


def comparison_table(groups: list[dict], target: float) -> tuple[list, list]:
    """(header, rows): one row per value; ``groups``: dicts with ``label``, ``aggregate`` and ``verdict``."""
    header = (["value", "runs ok", f"time to {target:.1%} (s)", f"trajectories to {target:.1%}"]
              + [c for c, _k in COMPARISON] + ["verdict"])
    rows = []
    for g in groups:
        a = g["aggregate"]
        rows.append([g["label"], f"{a['ok']}/{a['runs']}", _to_target(a, "time_to_target_s", "{:.0f}"),
                     _to_target(a, "trajectories_to_target", "{:.0f}")]
                    + [fmt_spread(a[k], BY_KEY[k].fmt) for _c, k in COMPARISON] + [g["verdict"]["outcome"]])
    return header, rows


def render_text(header: list[str], rows: list[list[str]]) -> str:
    """Columns aligned with spaces, for a terminal."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render_markdown(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in a cell escaped)."""
    cell = lambda c: str(c).replace("|", "\\|")
    out = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


# --- curves over seeds ----------------------------------------------------------------------------------


def mean_curve(curves: list[list[dict]], align: str, x: str, y: str) -> list[dict]:
    """Seeds' curves averaged point by point: points that share ``align`` (a version, a step) are one point.

    Each point: mean ``x``, mean ``y``, the band ``lo``..``hi`` (mean ± sd over
    seeds; None with one seed) and ``n``, the seeds that have the point.
    """
    by: dict = {}
    for c in curves:
        for p in c:
            if p.get(y) is not None:
                by.setdefault(p[align], []).append((p[x], p[y]))
    out = []
    for a in sorted(by):
        xs, ys = zip(*by[a])
        m = sum(ys) / len(ys)
        sd = statistics.stdev(ys) if len(ys) >= 2 else None
        out.append({"x": sum(xs) / len(xs), "y": m, "lo": None if sd is None else m - sd,
                    "hi": None if sd is None else m + sd, "n": len(ys)})
    return out
