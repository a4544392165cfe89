"""The workload format (shared/bench/README.md, docs/workloads.md) as `libra-ctl bench policy` reads it: files in
the format that were refused. Each test's comment says what happened before the fix."""

from __future__ import annotations

from pathlib import Path

from pipeline.sim import bench_allocator

try:  # pytest imports tests/ as a package when it has an __init__.py, else as a directory on sys.path
    from tests.test_input_faults import TINY
except ModuleNotFoundError:
    from test_input_faults import TINY

# test_input_faults' workload without its phase, at 16 GPUs and 1,024-trajectory batches; steps to fill in
HEAD = (TINY[:TINY.index("[[phase]]")].replace("gpus = 4\n", "gpus = 16\n")
        .replace("batch_size = 64\n", "batch_size = 1024\n").replace("steps = 3\n", "steps = {steps}\n"))
assert "gpus = 16" in HEAD and "batch_size = 1024" in HEAD and "{steps}" in HEAD

PHASE = """
[[phase]]
until_step = {until}
prompt_tokens = {prompt}
response_tokens = {{ median = {median}, p99 = {p99}, max = 16384 }}
"""


def _write(tmp_path: Path, text: str, name: str = "w.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_a_last_phase_that_outlasts_the_run_is_accepted_and_counted_only_up_to_steps(tmp_path):
    # The shared format says "a phase lasts until learner step until_step" and "steps = policy updates to
    # run"; nothing requires the last until_step to equal steps. A drift-like file cut short to 8 steps
    # (phases to 4, 8 and 12, as when a user lowers `steps` for a quick run) was refused before with
    # "the last [[phase]] has until_step = 12 but [job] steps = 8" (pipeline/sim/workload.py _phases).
    phases = [(4, 600, 1000, 6000), (8, 600, 2500, 12000), (12, 5000, 700, 4000)]
    long = HEAD.format(steps=8) + "".join(PHASE.format(until=u, prompt=p, median=m, p99=q) for u, p, m, q in phases)
    cut = HEAD.format(steps=8) + "".join(PHASE.format(until=u, prompt=p, median=m, p99=q)
                                         for u, p, m, q in phases[:2])
    out = bench_allocator.run_bench(_write(tmp_path, long, "long.toml"), modes=("ideal",))
    ref = bench_allocator.run_bench(_write(tmp_path, cut, "cut.toml"), modes=("ideal",))
    # the phase past the run's end never runs, so the bound is that of the first two phases
    assert out["modes"]["ideal"]["trajectories_per_s"] == ref["modes"]["ideal"]["trajectories_per_s"]


def test_a_length_given_as_a_number_says_it_must_be_a_table(tmp_path):
    # Before: `response_tokens = 1000` was reported as "is missing", and `tool_calls = 1`'s message ended in a
    # stray "}}".
    import pytest

    from pipeline.sim.workload import WorkloadError, load_workload

    body = HEAD.format(steps=8) + PHASE.format(until=8, prompt=600, median=1000, p99=4000)
    bad = body.replace("response_tokens = { median = 1000, p99 = 4000, max = 16384 }", "response_tokens = 1000")
    with pytest.raises(WorkloadError, match=r"response_tokens must be a table, not 1000"):
        load_workload(_write(tmp_path, bad, "a.toml"))
    with pytest.raises(WorkloadError) as exc:
        load_workload(_write(tmp_path, body + "tool_calls = 1\n", "b.toml"))
    assert str(exc.value).endswith("latency_p99_s = ... }")
