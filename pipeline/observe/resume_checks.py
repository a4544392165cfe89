"""The checks of ``libra-ctl verify-resume``: did a run killed mid-way resume without loss or restart?

Called by ``pipeline.verify_resume`` (the ``libra-ctl verify-resume``
process) once the killed-and-resumed run has finished, with the run
directory and the job's Redis. Two families of checks, each a ``Check``:

- accounting: ``libra-ctl audit`` (nothing lost, nothing trained twice),
  every checkpoint's records against the learner's step records, and the
  scored entries still unacknowledged against what the checkpoints say was
  trained (``check_audit``, ``check_checkpoints``, ``check_offsets``);
- continuity: the weights each restore loaded against those its checkpoint
  recorded, the learner's step numbers and policy versions across the kill,
  and the reward, batch-success and held-out success levels after the resume
  against those at the restored checkpoint and at the start of the run
  (``check_weights``, ``check_steps``, ``check_versions``, ``check_level``).

The level rule, in one line: a curve continues when its level after the
resume is within ``max(tol, |resumed - initial|)`` of the checkpoint's level,
with ``tol`` three standard errors of the difference of the two levels. So it
fails only when the resumed level is both outside the noise around the
checkpoint's level and nearer the initial level: a restart. A run too short
to have moved past the noise passes, and its line says the levels cannot be
told apart. The windows are chosen by ``windows``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import redis

from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_LEARNER, JobKeys
from pipeline.observe.audit import audit, checkpoint_records
from pipeline.observe.measures import read_jsonl
from pipeline.observe.trace import unix_time

WINDOW_MAX = 5      # learner steps in a level's window at most
TOL_SIGMAS = 3.0    # tolerance of a level comparison, in standard errors of the difference
TOL_FLOOR = 0.01    # and at least this (a window whose rewards were all equal has no spread)
SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class Check:
    """One line of the verdict: ``ok`` None when there was not enough data to decide (not a failure)."""

    name: str
    ok: bool | None
    detail: str
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[self.ok]
        return f"  {mark}  {self.name:<16} {self.detail}"


@dataclass
class Level:
    """A curve's level over a window: the mean, its standard error, and where it was read."""

    mean: float
    se: float
    where: str


@dataclass
class Split:
    """The learner's step records around the kill, and the checkpoint the learner restored."""

    pre: list[dict]           # records written before the kill, in file order
    post: list[dict]          # records written after it (by the resumed learner)
    checkpoint_step: int      # c: the latest complete checkpoint at the kill
    kill_step: int            # k: the last step trained before the kill; steps c+1..k were replayed
    steps: int                # job.steps

    @property
    def final(self) -> dict[int, dict]:
        """Step -> the record that stands: the resumed learner's for the replayed steps."""
        return {r["step"]: r for r in self.pre + self.post}


def learner_steps(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl", "learner_step")


def split_at(records: list[dict], kill_at: float, checkpoint_step: int, steps: int) -> Split:
    pre = [r for r in records if r["at"] <= kill_at]
    post = [r for r in records if r["at"] > kill_at]
    return Split(pre, post, checkpoint_step, max((r["step"] for r in pre), default=0), steps)


# --- continuity ------------------------------------------------------------------------------


def check_steps(s: Split) -> Check:
    """Before the kill steps 1..k, after it c+1..N, each once and in order; k > c (something was replayed)."""
    c, k, n = s.checkpoint_step, s.kill_step, s.steps
    got_pre, got_post = [r["step"] for r in s.pre], [r["step"] for r in s.post]
    want_pre, want_post = list(range(1, k + 1)), list(range(c + 1, n + 1))
    figures = {"checkpoint_step": c, "kill_step": k, "replayed": max(k - c, 0), "steps": n}
    problems = []
    if got_pre != want_pre:
        problems.append(f"before the kill {_steps_text(got_pre)}, expected 1-{k}")
    if got_post != want_post:
        problems.append(f"after the resume {_steps_text(got_post)}, expected {c + 1}-{n}"
                        + _diff_text(got_post, want_post))
    if k <= c:
        problems.append(f"the kill came at step {k}, on checkpoint {c}: nothing was replayed")
    if problems:
        return Check("steps", False, "; ".join(problems), figures)
    replayed = f"step {k}" if k == c + 1 else f"steps {c + 1}-{k}"
    return Check("steps", True, f"1-{k} before the kill, {c + 1}-{n} after the resume from checkpoint {c}: "
                 f"{replayed} replayed once, none repeated beyond them, none skipped", figures)


def check_versions(s: Split, checkpoint_version: int) -> Check:
    """After the resume the version starts above the checkpoint's and every earlier one, and only rises."""
    pre = [r["policy_version"] for r in s.pre]
    post = [r["policy_version"] for r in s.post]
    figures = {"before": [min(pre, default=0), max(pre, default=0)], "checkpoint": checkpoint_version,
               "after": [min(post, default=0), max(post, default=0)]}
    where = (f"v{figures['before'][0]}-v{figures['before'][1]} before the kill, checkpoint v{checkpoint_version}, "
             f"v{figures['after'][0]}-v{figures['after'][1]} after")
    if not post:
        return Check("versions", False, "no step after the resume", figures)
    rising = all(b > a for a, b in zip(post, post[1:]))
    if post[0] <= max(checkpoint_version, 0) or post[0] <= max(pre, default=0) or not rising:
        why = "went back" if post[0] <= max(pre, default=0) else "did not rise"
        return Check("versions", False, f"the version {why}: {where}", figures)
    return Check("versions", True, f"{where} (a restore publishes a new, higher version)", figures)


def windows(s: Split) -> dict[str, list[int]]:
    """The steps of each level: the start of the run, the end of the restored checkpoint, right after the resume.

    ``w = min(5, c // 2, N - k)`` steps each, so the first two never overlap:
    initial ``1..w``, checkpoint ``c-w+1..c``, resumed ``k+1..k+w``, the
    first steps after the replayed ones. The replayed steps train on work
    generated before the kill; the steps after them train on work the
    resumed pipeline generated with the restored weights, which is what
    shows whether the policy continued or restarted.
    """
    c, k, n = s.checkpoint_step, s.kill_step, s.steps
    w = min(WINDOW_MAX, c // 2, n - k)
    if w < 1:
        return {}
    return {"initial": list(range(1, w + 1)), "checkpoint": list(range(c - w + 1, c + 1)),
            "resumed": list(range(k + 1, k + w + 1))}


def step_level(final: dict[int, dict], steps: list[int], key: str) -> Level | None:
    """The window mean of ``reward_mean`` or ``success_rate``; each step's standard error counts groups.

    A group's trajectories share a prompt, so groups (not trajectories) are
    the independent samples: the standard error ``std / sqrt(groups)`` is
    the conservative one.
    """
    rows = [final[s] for s in steps if s in final]
    if not rows:
        return None
    vals = [float(r[key]) for r in rows]
    var = []
    for r, v in zip(rows, vals):
        n = max(int(r.get("groups") or r.get("trajectories") or 1), 1)
        std = float(r["reward_std"]) if key == "reward_mean" else math.sqrt(_smoothed(v, n) * (1 - _smoothed(v, n)))
        var.append(std * std / n)
    se = math.sqrt(sum(var)) / len(rows)
    return Level(sum(vals) / len(vals), se, _steps_text(steps))


def eval_level(ev: dict) -> Level:
    p, n = float(ev["success_rate"]), max(int(ev.get("n") or 1), 1)
    q = _smoothed(p, n)
    return Level(p, math.sqrt(q * (1 - q) / n), f"{ev['tag']} eval at v{ev['version']} ({n} prompts)")


def check_level(name: str, initial: Level | None, ckpt: Level | None, resumed: Level | None) -> Check:
    """Continues iff ``|resumed - ckpt| <= max(tol, |resumed - initial|)``, ``tol = 3 SE`` of the difference."""
    if initial is None or ckpt is None or resumed is None:
        missing = [w for w, lv in (("initial", initial), ("checkpoint", ckpt), ("resumed", resumed)) if lv is None]
        return Check(name, None, f"no {', '.join(missing)} level to compare", {})
    tol = max(TOL_SIGMAS * math.hypot(resumed.se, ckpt.se), TOL_FLOOR)
    d_ckpt, d_init = abs(resumed.mean - ckpt.mean), abs(resumed.mean - initial.mean)
    ok = d_ckpt <= max(tol, d_init)
    figures = {"initial": round(initial.mean, 4), "checkpoint": round(ckpt.mean, 4),
               "resumed": round(resumed.mean, 4), "tol": round(tol, 4), "d_checkpoint": round(d_ckpt, 4),
               "d_initial": round(d_init, 4), "windows": {"initial": initial.where, "checkpoint": ckpt.where,
                                                         "resumed": resumed.where}}
    nums = (f"initial {initial.mean:.3f} ({initial.where}), checkpoint {ckpt.mean:.3f} ({ckpt.where}), "
            f"resumed {resumed.mean:.3f} ({resumed.where}); |resumed-checkpoint| {d_ckpt:.3f}, "
            f"|resumed-initial| {d_init:.3f}, tol {tol:.3f}")
    if not ok:
        return Check(name, False, f"restarted: nearer the initial level than the checkpoint's; {nums}", figures)
    apart = abs(ckpt.mean - initial.mean) > max(TOL_SIGMAS * math.hypot(ckpt.se, initial.se), TOL_FLOOR)
    how = "continues from the checkpoint" if apart else "continues (the run had not moved past the noise yet)"
    return Check(name, True, f"{how}; {nums}", figures)


def eval_levels(evals: list[dict], kill_at: float, checkpoint_version: int,
                restored_version: int) -> tuple[Level | None, Level | None, Level | None]:
    """Held-out success: the start's, the last before the kill of weights the checkpoint holds, the first after.

    The checkpoint's eval is the latest one evaluated before the kill at a
    version no newer than the checkpoint's; the resumed one the first
    evaluated after the kill at the restored version or a later one.
    """
    start = next((e for e in evals if e["tag"] == "start"), None)
    before = [e for e in evals if e["at"] <= kill_at and e["tag"] != "start" and 0 < e["version"] <= checkpoint_version]
    after = [e for e in evals if e["at"] > kill_at and e["version"] >= restored_version]
    pick_after = sorted(after, key=lambda e: (e["tag"] == "final", e["at"]))  # a periodic one before the final
    return (eval_level(start) if start else None, eval_level(before[-1]) if before else None,
            eval_level(pick_after[0]) if pick_after else None)


def _smoothed(p: float, n: int) -> float:
    """A rate pulled off 0 and 1 (Laplace), so that a window of all-0 or all-1 still has a spread."""
    return (p * n + 1) / (n + 2)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "no step"
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ",".join(map(str, steps))


def _diff_text(got: list[int], want: list[int]) -> str:
    seen = [s for i, s in enumerate(got) if s in got[:i]]
    missing = sorted(set(want) - set(got))
    return "".join([f" (repeated {seen})" if seen else "", f" (skipped {missing})" if missing else ""])


# --- accounting --------------------------------------------------------------------------------


def check_audit(r: redis.Redis, job: str, run_dir: Path) -> tuple[Check, dict]:
    """``libra-ctl audit``: issued = trained + dropped + dead-lettered + in flight, nothing trained twice."""
    a = audit(r, job, str(run_dir))
    accounted = a["trained"] + a["dropped_stale"] + a["dead_lettered"] + a["in_flight"]
    lost = a["issued"] - accounted
    figures = {k: a[k] for k in ("issued", "trained", "dropped_stale", "dead_lettered", "in_flight",
                                 "duplicates_trained")} | {"lost": lost}
    nums = (f"issued {a['issued']} = trained {a['trained']} + stale {a['dropped_stale']} + dead-lettered "
            f"{a['dead_lettered']} + in flight {a['in_flight']}; lost {lost}, trained twice {a['duplicates_trained']}")
    if not a["ok"] or lost or a["duplicates_trained"]:
        return Check("audit", False, f"{'; '.join(a['problems']) or 'not ok'} ({nums})", figures), a
    return Check("audit", True, nums, figures), a


def check_checkpoints(run_dir: Path, final: dict[int, dict]) -> Check:
    """Every checkpoint records the ids its steps trained and dropped, and totals that add up.

    For checkpoint ``step-c`` after ``step-b``: ``consumed.txt`` holds as many
    ids as the step records ``b+1..c`` say were trained, ``dropped.txt`` as many
    as they dropped as stale, and ``state.json``'s totals are the sums of the
    records of every checkpoint up to it.
    """
    trained_sum = dropped_sum = prev = 0
    seen = []
    for ckpt in _complete_checkpoints(run_dir):
        state = _read_json(ckpt / "state.json")
        step = int(state["step"])
        consumed = len((ckpt / "consumed.txt").read_text().split())
        dropped = len((ckpt / "dropped.txt").read_text().split())
        rows = [final.get(s) for s in range(prev + 1, step + 1)]
        if any(row is None for row in rows):
            return Check("checkpoints", False, f"{ckpt.name}: no learner record of some of steps {prev + 1}-{step}")
        want_t, want_d = sum(int(x["trajectories"]) for x in rows), sum(int(x["dropped_stale"]) for x in rows)
        trained_sum, dropped_sum = trained_sum + consumed, dropped_sum + dropped
        problems = []
        if consumed != want_t:
            problems.append(f"records {consumed} trained ids, its steps {prev + 1}-{step} trained {want_t}")
        if dropped != want_d:
            problems.append(f"records {dropped} stale ids, its steps dropped {want_d}")
        if "trained_total" in state and (state["trained_total"], state["dropped_total"]) != (trained_sum, dropped_sum):
            problems.append(f"totals trained {state['trained_total']}, stale {state['dropped_total']} != "
                            f"its records' {trained_sum}, {dropped_sum}")
        if problems:
            return Check("checkpoints", False, f"{ckpt.name}: " + "; ".join(problems),
                         {"checkpoint": ckpt.name, "recorded": consumed, "trained": want_t})
        seen.append(step)
        prev = step
    if not seen:
        return Check("checkpoints", False, "no complete checkpoint in the run directory")
    return Check("checkpoints", True, f"{len(seen)} checkpoints (steps {','.join(map(str, seen))}) record the "
                 f"{trained_sum} ids their steps trained and the {dropped_sum} they dropped", {"steps": seen})


def check_offsets(r: redis.Redis, keys: JobKeys, run_dir: Path, max_bytes: int) -> Check:
    """No scored entry the learner has not acknowledged (pending or undelivered) holds an id a checkpoint trained.

    Such an entry would be trained again by the next learner-0: its
    acknowledgement fell behind its checkpoint.
    """
    if not r.exists(keys.scored):
        return Check("offsets", True, "no scored stream left to check")
    trained = set(checkpoint_records(run_dir, "consumed.txt"))
    pending = [p["message_id"] for p in r.xpending_range(keys.scored, GROUP_LEARNER, "-", "+", 10**6)]
    last = next((g["last-delivered-id"] for g in r.xinfo_groups(keys.scored)
                 if g["name"] in (GROUP_LEARNER, GROUP_LEARNER.encode())), b"0-0")
    entries = [e for pid in pending for e in r.xrange(keys.scored, pid, pid)]
    entries += r.xrange(keys.scored, b"(" + _as_bytes(last), "+")
    both = []
    for entry_id, f in entries:
        try:
            g = messages.decode(f.get(messages.FIELD, b""), max_bytes)
        except messages.BadMessage:
            continue  # dead-lettered by the learner when it reads it; never trained
        ids = set(g.trajectory_ids()) if isinstance(g, messages.Group) else set()
        if ids & trained:
            both.append(_as_bytes(entry_id).decode())
    figures = {"unacknowledged": len(entries), "pending": len(pending), "trained_but_unacknowledged": len(both)}
    if both:
        return Check("offsets", False, f"{len(both)} scored entries still unacknowledged by the learner hold ids a "
                     f"checkpoint records as trained (e.g. {both[:3]})", figures)
    return Check("offsets", True, f"{len(entries)} scored entries left unacknowledged ({len(pending)} pending at the "
                 "learner), none holding an id a checkpoint trained", figures)


def check_weights(run_dir: Path, kill_at: float) -> Check:
    """Each restore after the kill loaded the weights its checkpoint recorded (``weights_sha256`` of its
    ``state.json`` against the digest of the weights in memory the learner logged when it restored).

    Steps, versions and counters are restored from ``state.json`` whatever weights are loaded: only this
    tells a resume that went on from the checkpoint's policy from one that went back to other weights.
    """
    restores = sorted((rec for path in (run_dir / "logs").glob("*.jsonl") for rec in read_jsonl(path)
                       if rec.get("event") == "restored" and (unix_time(rec.get("timestamp")) or 0) > kill_at),
                      key=lambda rec: unix_time(rec["timestamp"]))
    if not restores:
        return Check("weights", False, "no learner logged a restore from a checkpoint after the kill")
    problems, unrecorded, names = [], 0, []
    for rec in restores:
        ckpt = Path(rec["checkpoint"])
        names.append(ckpt.name)
        recorded = _read_json(ckpt / "state.json").get("weights_sha256") if (ckpt / "state.json").exists() else None
        loaded = rec.get("weights_sha256")
        if recorded is None or loaded is None:
            unrecorded += 1
        elif loaded != recorded:
            problems.append(f"{ckpt.name}: loaded sha256 {loaded[:12]}, the checkpoint recorded {recorded[:12]}")
    figures = {"restores": len(restores), "checkpoints": names}
    if problems:
        return Check("weights", False, "a restore loaded other weights than its checkpoint's: "
                     + "; ".join(problems), figures)
    if unrecorded:
        return Check("weights", None, f"{unrecorded} of {len(restores)} restores cannot be compared (a checkpoint "
                     "or a learner of a version that recorded no weights digest)", figures)
    return Check("weights", True, f"{len(restores)} restore(s) ({', '.join(names)}) loaded the weights the "
                 "checkpoint recorded (SHA-256 of every parameter)", figures)


def checkpoint_state(run_dir: Path, step: int) -> dict:
    return _read_json(run_dir / "checkpoints" / f"step-{step:06d}" / "state.json")


def latest_complete_step(run_dir: Path) -> int | None:
    done = _complete_checkpoints(run_dir)
    return int(_read_json(done[-1] / "state.json")["step"]) if done else None


def _complete_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints a restore could pick, by step: ``step-<digits>`` with a state.json, as the learner
    and the audit read them (a ``.tmp`` in progress, or a copy kept as ``step-000004.old``, is none)."""
    ckpts = [p for p in (run_dir / "checkpoints").glob("step-*")
             if p.name[5:].isdigit() and (p / "state.json").exists()]
    return sorted(ckpts, key=lambda p: int(p.name[5:]))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _as_bytes(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


# --- pictures ----------------------------------------------------------------------------------


def sparkline(values: list[float | None], lo: float, hi: float) -> str:
    """One character per value on a shared scale; a blank where there is none."""
    span = (hi - lo) or 1.0
    return "".join(" " if v is None else SPARK[min(int((v - lo) / span * len(SPARK)), len(SPARK) - 1)]
                   for v in values)


def spark_lines(s: Split, key: str, label: str) -> list[str]:
    """The curve before the kill and after the resume, aligned on the step axis (one column a step)."""
    pre = {r["step"]: float(r[key]) for r in s.pre}
    post = {r["step"]: float(r[key]) for r in s.post}
    vals = list(pre.values()) + list(post.values())
    if not vals:
        return []
    lo, hi = min(vals), max(vals)
    row_pre = sparkline([pre.get(i) for i in range(1, s.steps + 1)], lo, hi)
    row_post = sparkline([post.get(i) for i in range(1, s.steps + 1)], lo, hi)
    marks = "".join("^" if i == s.checkpoint_step else "x" if i == s.kill_step else " "
                    for i in range(1, s.steps + 1))
    return [f"  {label:<8} before kill  |{row_pre}|  {lo:.2f}..{hi:.2f}",
            f"  {'':<8} after resume |{row_post}|",
            f"  {'':<8}              |{marks}|  ^ checkpoint restored (step {s.checkpoint_step}), "
            f"x kill (step {s.kill_step})"]


def plot(path: Path, s: Split, evals: list[dict], version_step: dict[int, int], title: str) -> Path:
    """Reward and success per step, before the kill and after the resume, with the held-out evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    for ax, key, label in ((axes[0], "reward_mean", "reward (batch mean)"),
                           (axes[1], "success_rate", "success")):
        for rows, name, style in ((s.pre, "before the kill", "-o"), (s.post, "after the resume", "-s")):
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], style, ms=3, label=name)
        ax.axvline(s.checkpoint_step, color="green", ls="--", lw=1, label=f"checkpoint restored ({s.checkpoint_step})")
        ax.axvline(s.kill_step, color="red", ls=":", lw=1.5, label=f"kill ({s.kill_step})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    pts = [(version_step[e["version"]], e["success_rate"]) for e in evals if e["version"] in version_step]
    if pts:
        axes[1].plot(*zip(*pts), "D", color="black", ms=5, label="held-out eval (greedy)")
    axes[1].set_xlabel("learner step")
    axes[0].set_title(title, fontsize=10)
    axes[1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
