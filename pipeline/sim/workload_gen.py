"""Random one-job workloads for the policy sweep (``libra-ctl bench policy --sweep N``).

Called by ``pipeline.sim.bench_sweep`` in the CLI process, once per workload of
a sweep; ``random_workload(rng)`` returns a TOML-able dict in the format of
``docs/workloads.md`` that ``workload.parse_workload`` accepts (it is passed
through it before it is returned), and ``to_toml`` writes one out.

Ranges (plausible for agentic RL post-training; log-uniform where a range
spans more than a factor of three, so that each order of magnitude gets its share):

- cluster: 16–1,024 GPUs (log-uniform), switch cost 20–120 s;
- rollout: 16–256 sequences per GPU, 20–80 decode tokens/s per sequence,
  5k–40k prefill tokens/s per GPU, weight load 1–15 s;
- reward: on GPU with probability 0.4, 0.01–0.5 s per trajectory per GPU
  worker; else CPU sandboxes, 2–32 workers per GPU at 0.02–5 s per trajectory
  (tests that run code), which can cap the whole pipeline;
- learner: 2k–20k tokens/s per GPU, scaling exponent 0.8–1.0, publish 1–10 s;
- job: group size 4, 8 or 16; the batch and the staleness bound are sized
  from the draft's ideal rates (``_job``): 1–4 times the trajectories in
  flight at the ideal rate, a step of at least a minute and five weight
  syncs, a bound of 1, 2, 4 or 8 versions that admits twice the trajectories
  in flight; at most 62,500 trajectories a batch;
- phases: one to three; the first draws prompts of 100–8,000 tokens,
  responses of median 200–8,000 tokens with p99 2–8 x the median (cut at the
  next power of two above p99 in two draws of three), 0.5–8 tool calls of
  median latency 0.1–5 s with p99 2–20 x the median (none in one draw of
  five); each later phase drifts from the one before: prompts, responses and
  tool latencies x 1/3–3, tool calls x 1/2–2 (a phase without tools gives
  the next 1/4–4 calls), within the same ranges;
- steps: as many as make the run last 1–3 simulated hours at the ideal rate,
  within 20–200 steps and at most 1.5 M trajectories (so that one run of
  the des engine stays within seconds), with at least 8 steps per phase.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipeline.sim import fluid
from pipeline.sim.workload import Phase, Workload, parse_workload

GPUS = (16, 1024)
MIN_STEPS, MAX_STEPS, STEPS_PER_PHASE = 20, 200, 8
MIN_STEP_S = 60.0
MAX_TRAJECTORIES = 1_500_000
MAX_PHASES = 3
MAX_BATCH = MAX_TRAJECTORIES // max(MIN_STEPS, STEPS_PER_PHASE * MAX_PHASES)
RUN_HOURS = (1.0, 3.0)
PROMPT_TOKENS = (100.0, 8000.0)
RESPONSE_MEDIAN = (200.0, 8000.0)
TOOL_LATENCY_MEDIAN_S = (0.1, 5.0)
TOOL_CALLS = (0.0, 8.0)


def random_workload(rng: np.random.Generator, name: str = "random",
                    gpus_range: tuple[int, int] = GPUS) -> dict[str, Any]:
    """One valid one-job workload drawn from ``rng`` (the ranges of the module docstring).

    ``gpus_range`` narrows the cluster sizes (a sweep of large clusters only, or a quick test).
    """
    lo, hi = gpus_range
    if not 3 <= lo <= hi:
        raise ValueError(f"GPU range {lo}-{hi}: give 3 <= min <= max (a pool needs a rollout, a learner "
                         "and maybe a reward GPU)")
    gpus = int(round(_log_uniform(rng, lo, hi)))
    data: dict[str, Any] = {
        "name": name,
        "cluster": {"gpus": gpus, "switch_cost_s": _round(rng.uniform(20.0, 120.0))},
        "rollout": {"concurrency": int(rng.choice([16, 32, 64, 128, 256])),
                    "decode_tokens_per_s": _round(rng.uniform(20.0, 80.0)),
                    "prefill_tokens_per_s": _round(_log_uniform(rng, 5000.0, 40000.0), -2),
                    "weight_sync_s": _round(rng.uniform(1.0, 15.0))},
        "reward": _reward(rng, gpus),
        "learner": {"train_tokens_per_s": _round(_log_uniform(rng, 2000.0, 20000.0), -1),
                    "scaling_exponent": _round(rng.uniform(0.8, 1.0), 3),
                    "weight_publish_s": _round(rng.uniform(1.0, 10.0))},
    }
    phases = [_first_phase(rng)]
    for _ in range(int(rng.integers(0, MAX_PHASES))):
        phases.append(_drift(rng, phases[-1]))
    data["phase"] = phases
    data["job"] = _job(rng, data)
    parse_workload(data, f"<{name}>")     # valid by construction; a bad draw is a bug here
    return data


def _reward(rng: np.random.Generator, gpus: int) -> dict[str, Any]:
    if rng.random() < 0.4:
        return {"gpu": True, "seconds": _round(_log_uniform(rng, 0.01, 0.5), 3)}
    return {"gpu": False, "seconds": _round(_log_uniform(rng, 0.02, 5.0), 3),
            "cpu_workers": int(round(gpus * _log_uniform(rng, 2.0, 32.0)))}


def _first_phase(rng: np.random.Generator) -> dict[str, Any]:
    median = _log_uniform(rng, *RESPONSE_MEDIAN)
    tools = _log_uniform(rng, 0.5, TOOL_CALLS[1]) if rng.random() >= 0.2 else 0.0
    return _phase(rng, _log_uniform(rng, *PROMPT_TOKENS), median, median * rng.uniform(2.0, 8.0),
                  tools, _log_uniform(rng, *TOOL_LATENCY_MEDIAN_S), rng.uniform(2.0, 20.0))


def _drift(rng: np.random.Generator, prev: dict[str, Any]) -> dict[str, Any]:
    """The next phase: prompts, responses and tool latencies x 1/3–3, tool calls x 1/2–2."""
    resp, tools = prev["response_tokens"], prev.get("tool_calls")
    median = _clip(resp["median"] * _log_uniform(rng, 1 / 3, 3.0), RESPONSE_MEDIAN)
    calls = tools["per_trajectory"] if tools else _log_uniform(rng, 0.5, 2.0)
    lat = tools["latency_median_s"] if tools else _log_uniform(rng, *TOOL_LATENCY_MEDIAN_S)
    tail = tools["latency_p99_s"] / tools["latency_median_s"] if tools else rng.uniform(2.0, 20.0)
    return _phase(rng, _clip(prev["prompt_tokens"] * _log_uniform(rng, 1 / 3, 3.0), PROMPT_TOKENS),
                  median, median * resp["p99"] / resp["median"],
                  _clip(calls * _log_uniform(rng, 0.5, 2.0), TOOL_CALLS),
                  _clip(lat * _log_uniform(rng, 1 / 3, 3.0), TOOL_LATENCY_MEDIAN_S), tail)


def _phase(rng: np.random.Generator, prompt: float, median: float, p99: float, calls: float,
           latency_median_s: float, latency_tail: float) -> dict[str, Any]:
    """A [[phase]] table (until_step is set by ``_size_steps``); the cut is drawn here."""
    median, p99 = round(median), round(p99)
    response: dict[str, Any] = {"median": median, "p99": max(p99, median)}
    if rng.random() < 2 / 3:
        response["max"] = 2 ** math.ceil(math.log2(max(p99, median)))
    ph: dict[str, Any] = {"until_step": 0, "prompt_tokens": round(prompt), "response_tokens": response}
    if calls > 0:
        lat = _round(latency_median_s, 2)
        ph["tool_calls"] = {"per_trajectory": _round(calls, 1), "latency_median_s": lat,
                            "latency_p99_s": _round(lat * latency_tail, 2)}
    return ph


def _job(rng: np.random.Generator, data: dict[str, Any]) -> dict[str, Any]:
    """Batch, staleness bound and steps sized from the draft's ideal rates; sets the phases' until_step.

    A careful user fills the rollout fleet: the batch is 1–4 times the mean
    number of trajectories in flight at the ideal rate (Little's law: rate x
    slot time) in the phase that needs most, and a step lasts at least a
    minute and five weight syncs. The staleness bound is drawn among those
    that admit twice that many in flight ((bound + 1) x batch), so that no
    policy is starved by admission alone, which the ideal bound ignores.
    """
    draft = _parsed(data)
    group = int(rng.choice([4, 8, 16]))
    rates = np.array([fluid.ideal_phase_rate(draft, ph) for ph in draft.job.phases])
    in_flight = max(r * _slot_s(draft, ph) for r, ph in zip(rates, draft.job.phases))
    min_step_s = max(MIN_STEP_S, 5 * (draft.rollout.weight_sync_s + draft.learner.weight_publish_s))
    batch = max(_log_uniform(rng, 1.0, 4.0) * in_flight, min_step_s * rates.max(), 2 * group)
    batch = min(math.ceil(batch / group), MAX_BATCH // group) * group
    bounds = [m for m in (1, 2, 4, 8) if (m + 1) * batch >= 2 * in_flight] or [8]
    step_s = batch * float(np.mean(1 / rates))      # phases of equal steps, for the draw below
    fewest = max(MIN_STEPS, STEPS_PER_PHASE * len(rates))
    steps = int(np.clip(round(_log_uniform(rng, *RUN_HOURS) * 3600 / step_s), fewest,
                        max(fewest, min(MAX_STEPS, MAX_TRAJECTORIES // batch))))
    spare = steps - STEPS_PER_PHASE * len(rates)
    cuts = np.sort(rng.integers(0, spare + 1, len(rates) - 1))
    for i, ph in enumerate(data["phase"]):
        ph["until_step"] = steps if i == len(rates) - 1 else int(cuts[i]) + STEPS_PER_PHASE * (i + 1)
    return {"batch_size": batch, "group_size": group, "max_staleness": int(rng.choice(bounds)),
            "steps": steps, "seed": int(rng.integers(0, 2**31))}


def _slot_s(wl: Workload, ph: Phase) -> float:
    """Mean seconds a trajectory holds its decode slot: decode plus tool waits."""
    return ph.response_tokens.mean() / wl.rollout.decode_tokens_per_s + ph.tool_calls.mean_wait_s()


def _parsed(data: dict[str, Any]) -> Workload:
    """The draft (no [job] yet) parsed with one-step phases and one-group batches, for its ideal rates."""
    n = len(data["phase"])
    draft = {**data, "job": {"batch_size": 1, "group_size": 1, "max_staleness": 1, "steps": n},
             "phase": [{**ph, "until_step": i + 1} for i, ph in enumerate(data["phase"])]}
    return parse_workload(draft, f"<{data['name']} draft>")


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _clip(x: float, bounds: tuple[float, float]) -> float:
    return float(min(max(x, bounds[0]), bounds[1]))


def _round(x: float, digits: int = 1) -> float:
    return float(round(x, digits))


# --- TOML ---------------------------------------------------------------------

def to_toml(data: dict[str, Any], comment: str = "") -> str:
    """The workload dict as TOML in the layout of ``examples/bench/*.toml``; ``comment`` lines go on top."""
    lines = [f"# {c}" if c else "#" for c in comment.splitlines()]
    lines.append(f"name = {_value(data['name'])}")
    for table in ("cluster", "rollout", "reward", "learner", "job"):
        lines += ["", f"[{table}]"] + [f"{k} = {_value(v)}" for k, v in data[table].items()]
    for ph in data["phase"]:
        lines += ["", "[[phase]]"] + [f"{k} = {_value(v)}" for k, v in ph.items()]
    return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (int, float)):
        return repr(v)
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as a workload value")
