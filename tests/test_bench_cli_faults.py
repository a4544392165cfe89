"""``libra-ctl bench policy`` / ``bench streams`` as a user drives them from a shell: one clear line and an exit
status, not a Python traceback, when an output path cannot be written (checked before minutes of work), a Redis
setting or a workload size is out of range, or the user presses Ctrl-C. A review found each a traceback (or a
misleading line); the docstrings say what happened before.

Each test runs the real CLI in a subprocess, with no mocks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-m", "pipeline.cli"]

SMALL = """\
name = "small"
[cluster]
gpus = {gpus}
switch_cost_s = 10.0
[rollout]
concurrency = 16
decode_tokens_per_s = 45.0
prefill_tokens_per_s = 20000.0
weight_sync_s = 1.0
[reward]
gpu = false
seconds = 0.05
cpu_workers = 8
[learner]
train_tokens_per_s = 6000.0
scaling_exponent = 0.95
weight_publish_s = 1.0
[job]
batch_size = 64
group_size = 8
max_staleness = 4
steps = 12
seed = 0
[[phase]]
until_step = 12
prompt_tokens = 200
response_tokens = {{ median = 300, p99 = 1200, max = 2048 }}
"""


def _workload(tmp_path: Path, gpus: int = 8) -> Path:
    p = tmp_path / "small.toml"
    p.write_text(SMALL.format(gpus=gpus))
    return p


def _ctl(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _no_traceback(proc: subprocess.CompletedProcess | tuple, what: str) -> None:
    err = proc.stderr if hasattr(proc, "stderr") else proc[1]
    assert "Traceback" not in err, f"{what}: a traceback instead of one clear line:\n{err[-2500:]}"


def _interrupt_when(args: list[str], ready: str, tmp_path: Path, timeout: float = 90,
                    group: bool = False) -> tuple[int, str, list]:
    """Start the CLI, send SIGINT once ``ready`` shows on its stderr: to the CLI alone, or with ``group`` to
    its whole process group, as a terminal's Ctrl-C does; (rc, stderr, leftovers)."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_f:
        p = subprocess.Popen(CTL + args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err_f, start_new_session=group,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + timeout
            while ready not in err_path.read_text():
                assert p.poll() is None, f"finished before {ready!r} showed:\n{err_path.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"{ready!r} never showed:\n{err_path.read_text()[-2000:]}"
                time.sleep(0.1)
            kids = psutil.Process(p.pid).children(recursive=True)
            if group:
                os.killpg(p.pid, signal.SIGINT)
            else:
                p.send_signal(signal.SIGINT)
            rc = p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    time.sleep(1.0)
    left = [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
    for k in left:           # ours: started by the CLI under test
        k.kill()
    return rc, err_path.read_text(), left


# --- Ctrl-C -------------------------------------------------------------------------------------------------------

def test_ctrl_c_in_a_sweep_prints_one_line_not_a_traceback(tmp_path):
    """docs/bench.md (Sweep): a user stops ``--sweep N`` with Ctrl-C; the single-workload path prints
    'interrupted' and exits 130, the sweep path dumps a KeyboardInterrupt traceback from inside the des engine."""
    rc, err, left = _interrupt_when(["bench", "policy", "--sweep", "8", "--seed", "2", "--sweep-gpus", "16", "64"],
                                    "sweep 1/8", tmp_path)
    assert not left
    _no_traceback(("", err), "Ctrl-C in bench policy --sweep")
    assert rc == 130, rc
    assert "interrupted" in err.strip().splitlines()[-1]


def test_ctrl_c_in_bench_streams_prints_one_line_not_a_traceback(tmp_path):
    """README 'Throughput benchmark': ``libra-ctl bench streams``; Ctrl-C in the middle cleans its processes and
    Redis up (good) but ends in a KeyboardInterrupt traceback and exit -2 instead of one line and 130."""
    rc, err, left = _interrupt_when(["bench", "streams", "--seconds", "5", "--warmup", "1", "--rounds", "2"],
                                    "bench streams:", tmp_path)
    assert not left, [k.pid for k in left]
    _no_traceback(("", err), "Ctrl-C in bench streams")
    assert rc == 130, rc


def test_ctrl_c_at_a_terminal_stops_bench_streams_with_one_line(tmp_path):
    """A terminal's Ctrl-C reaches every process of the foreground group, the stage processes too: each
    printed its own KeyboardInterrupt traceback ("Process bench-reward-0: Traceback ...") above the CLI's line."""
    rc, err, left = _interrupt_when(["bench", "streams", "--seconds", "5", "--warmup", "1", "--rounds", "2"],
                                    "bench streams:", tmp_path, group=True)
    assert not left, [k.pid for k in left]
    _no_traceback(("", err), "Ctrl-C at a terminal in bench streams")
    assert rc == 130, rc
    assert "interrupted" in err.strip().splitlines()[-1]


def test_ctrl_c_while_bench_streams_starts_its_stages_is_not_lost(tmp_path):
    """A Ctrl-C that came while a stage process was forked ran inside the fork's hooks: Python printed
    "Exception ignored ... KeyboardInterrupt" and dropped it, and the benchmark ran on to its end (CI saw it).
    Interrupted right as a round starts its stages (four rounds, each forks its stages anew), every try ends
    with one line and 130."""
    for attempt in range(3):
        (tmp_path / str(attempt)).mkdir()
        rc, err, left = _interrupt_when(["bench", "streams", "--seconds", "1", "--warmup", "0.2", "--rounds", "4",
                                         "--consumers", "4"], "trajectories/s", tmp_path / str(attempt))
        assert not left, [k.pid for k in left]
        _no_traceback(("", err), f"Ctrl-C as bench streams forks its stages (try {attempt})")
        assert rc == 130, (attempt, rc, err[-1500:])


def test_ctrl_c_on_the_des_engine_does_not_claim_live_processes(tmp_path):
    """Ctrl-C during a des-engine run (no processes started) prints 'the live engine's processes are stopped',
    which tells the user about processes that never existed."""
    wl = Path(ROOT / "examples" / "bench" / "drift.toml")
    rc, err, _ = _interrupt_when(["bench", "policy", str(wl)], "static-best: trying", tmp_path)
    assert rc == 130
    last = err.strip().splitlines()[-1]
    assert "interrupted" in last
    assert "live engine" not in last, last


# --- output paths ---------------------------------------------------------------------------------------------------

def test_json_into_a_missing_directory_is_one_line_not_a_traceback(tmp_path):
    """``bench policy W --json OUT`` where OUT's directory does not exist: the whole run happens (25 minutes
    for a live drift run), then a FileNotFoundError traceback and the JSON is lost. ``bench rollout`` checks its
    --json directory before it starts (docs/bench.md); ``bench policy`` should too."""
    out = tmp_path / "no-such-dir" / "out.json"
    proc = _ctl(["bench", "policy", str(_workload(tmp_path)), "--modes", "ideal", "--json", str(out)])
    _no_traceback(proc, "--json into a missing directory")
    assert proc.returncode == 2, proc.returncode
    assert str(out) in proc.stderr or "no-such-dir" in proc.stderr


def test_plot_into_a_missing_directory_is_one_line_not_a_traceback(tmp_path):
    out = tmp_path / "no-such-dir" / "out.png"
    proc = _ctl(["bench", "policy", str(_workload(tmp_path)), "--modes", "ideal", "--plot", str(out)])
    _no_traceback(proc, "--plot into a missing directory")
    assert proc.returncode == 2, proc.returncode


def test_sweep_json_into_a_missing_directory_is_one_line_not_a_traceback(tmp_path):
    """After the whole sweep ran: --json into a missing directory (and, below, --save-worst naming a file) raise
    FileNotFoundError / FileExistsError tracebacks; the figures are lost."""
    base = ["bench", "policy", "--sweep", "1", "--sweep-gpus", "16", "16", "--modes", "libra,ideal"]
    proc = _ctl(base + ["--json", str(tmp_path / "no-such-dir" / "s.json")])
    _no_traceback(proc, "--sweep --json into a missing directory")
    assert proc.returncode == 2


def test_sweep_save_worst_naming_a_file_is_one_line_not_a_traceback(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    base = ["bench", "policy", "--sweep", "1", "--sweep-gpus", "16", "16", "--modes", "libra,ideal"]
    proc = _ctl(base + ["--save-worst", str(a_file)])
    _no_traceback(proc, "--sweep --save-worst naming a file")
    assert proc.returncode == 2


def test_bench_streams_json_into_a_missing_directory_is_one_line(tmp_path):
    proc = _ctl(["bench", "streams", "--seconds", "1", "--warmup", "0", "--rounds", "1",
                 "--json", str(tmp_path / "no-such-dir" / "s.json")])
    _no_traceback(proc, "bench streams --json into a missing directory")
    assert proc.returncode == 2


# --- bad values --------------------------------------------------------------------------------------------------------

def test_bench_streams_unknown_redis_config_key_is_one_line(tmp_path):
    """docs/guarantees.md: --redis-config KEY=VALUE is a CONFIG SET on the embedded server. A key Redis does not
    know (a typo) ends in redis.exceptions.ResponseError's traceback instead of one line naming the key."""
    proc = _ctl(["bench", "streams", "--seconds", "1", "--warmup", "0", "--rounds", "1",
                 "--redis-config", "apendonly=no"])
    _no_traceback(proc, "--redis-config with an unknown key")
    assert proc.returncode == 2
    assert "apendonly" in proc.stderr


def test_a_workload_with_an_absurd_gpu_count_is_refused_in_one_line(tmp_path):
    """docs/workloads.md: 'A file that breaks any rule below is refused before anything runs: the command exits 2
    with one line'. ``gpus = 100000000000`` (a typo of 100) passes validation, then fluid._integer_splits
    dies with numpy's _ArrayMemoryError traceback (745 GiB). The same for ``[rollout] concurrency = 1e9``."""
    proc = _ctl(["bench", "policy", str(_workload(tmp_path, gpus=100_000_000_000)), "--modes", "static,ideal"])
    _no_traceback(proc, "gpus = 1e11")
    assert proc.returncode == 2
    assert "gpus" in proc.stderr
