"""Inputs a user writes that used to be taken wrongly: workload files, bench flags, job configs, manifests.

Each is refused with a message naming the key or flag, or taken as meant;
none ends in a traceback from deep inside a run.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from pipeline import config as config_mod
from pipeline import manifest as manifest_mod
from pipeline.sim import bench_allocator
from pipeline.sim.bench_live import LiveSettings
from pipeline.sim.workload import WorkloadError, load_workload, parse_workload

# a one-phase workload small enough that every mode runs in well under a second
TINY = """\
name = "tiny"

[cluster]
gpus = 4
switch_cost_s = 40.0

[rollout]
concurrency = 64
decode_tokens_per_s = 45.0
prefill_tokens_per_s = 20000.0
weight_sync_s = 3.0

[reward]
gpu = false
seconds = 0.05
cpu_workers = 32

[learner]
train_tokens_per_s = 6000.0
scaling_exponent = 0.95
weight_publish_s = 2.0

[job]
batch_size = 64
group_size = 8
max_staleness = 4
steps = 3
seed = 0

[[phase]]
until_step = 3
prompt_tokens = 800
response_tokens = { median = 1200, p99 = 5000, max = 12288 }
tool_calls = { per_trajectory = 2, latency_median_s = 0.5, latency_p99_s = 4.0 }
"""


def _write(tmp_path: Path, text: str, name: str = "w.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _cli(argv) -> int:
    parser = argparse.ArgumentParser()
    bench_allocator.add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


# --- workload files ------------------------------------------------------------------------------


def test_a_negative_workload_seed_is_refused_naming_it():
    """``[job] seed = -1`` is refused by the parser (numpy's generators take no negative seed: every mode
    used to die inside ``default_rng`` with a traceback naming no key)."""
    data = tomllib.loads(TINY.replace("seed = 0", "seed = -1"))
    with pytest.raises(WorkloadError, match="seed"):
        parse_workload(data, "neg-seed.toml")


@pytest.mark.parametrize("extra", [[], ["--sweep", "1", "--sweep-gpus", "4", "6"]])
def test_a_negative_seed_flag_is_refused_naming_seed(tmp_path, capsys, extra):
    """``bench policy W.toml --seed -3`` (a traceback from numpy before) and ``--sweep 1 --seed -1`` (which
    blamed ``--sweep-gpus``) exit 2 with a message naming ``--seed``."""
    argv = ["policy"] + ([] if extra else [str(_write(tmp_path, TINY))]) + ["--seed", "-3", *extra]
    with pytest.raises(SystemExit) as exc:
        _cli(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --seed: -3: must be at least 0" in err, err


def test_response_tokens_unknown_key_is_rejected():
    """A misspelt key of ``response_tokens`` (``cap`` for ``max``) is refused naming it, as unknown keys are
    everywhere else in the format (the cut was dropped silently: another mean length, another ideal)."""
    data = tomllib.loads(TINY.replace("max = 12288", "cap = 12288"))
    with pytest.raises(WorkloadError, match="cap"):
        parse_workload(data, "typo.toml")


def test_huge_integer_value_gives_a_workload_error(tmp_path):
    """An integer no float holds (``switch_cost_s = 1`` and 400 zeros; TOML takes it) is a WorkloadError
    naming the key, not an OverflowError."""
    p = _write(tmp_path, TINY.replace("switch_cost_s = 40.0", "switch_cost_s = 1" + "0" * 400))
    with pytest.raises(WorkloadError, match="switch_cost_s"):
        load_workload(p)


def test_live_check_refuses_a_workload_the_live_engine_cannot_configure():
    """``group_size = 1`` (valid for the format and the des engine) is refused up front for ``--engine live``,
    whose job config needs groups of 2 or more: it used to run every des mode, then die on
    ``rollout.group_size``, a key the workload does not have."""
    data = tomllib.loads(TINY.replace("group_size = 8", "group_size = 1"))
    wl = parse_workload(data, "group1.toml")
    with pytest.raises(ValueError, match="group_size"):
        LiveSettings().check(wl)


# --- job configs ---------------------------------------------------------------------------------


def test_set_string_field_to_a_number_like_word():
    """``--set job.name=42`` and ``--set tracking.run_name=2024-06-01`` set those strings (TOML reads the
    words as an int and a date, and the override was refused: "expected str")."""
    cfg = config_mod.load(None, ["job.name=42", "tracking.run_name=2024-06-01"])
    assert cfg.job.name == "42"
    assert cfg.tracking.run_name == "2024-06-01"


@pytest.mark.parametrize("setting", ["learner.threads=0", "rollout.groups_per_call=0"])
def test_a_count_below_one_that_kills_a_worker_at_start_is_refused(setting):
    """``learner.threads = 0`` (torch.set_num_threads raises at the learner's start) and
    ``rollout.groups_per_call = 0`` (XREADGROUP COUNT 0: redis-py refuses it on every rollout worker's
    first read) are refused when the job is loaded, naming the key."""
    with pytest.raises(config_mod.ConfigError, match=setting.split("=")[0].replace(".", r"\.")):
        config_mod.load(None, [setting])


# --- manifests -----------------------------------------------------------------------------------


def test_manifest_keeps_env_options_that_workers_reload(tmp_path):
    """Workers (and a resume) rebuild their config from manifest.json: an environment option holding a
    tool service's URL with a token reaches them as given, not as ``https://bot:***@...``; the report
    shows it redacted."""
    from pipeline.dataplane.worker import load_run_config

    cfg = config_mod.load(None, ['env.options={api = "https://bot:s3cret@tools.example/v1"}'])
    manifest_mod.write_manifest(tmp_path, cfg, argv=[], redis_url="", embedded=False, policy_dir="",
                                bad_prompt_lines=[])
    assert load_run_config(tmp_path).env.options == cfg.env.options
    from pipeline.observe.report import write_report

    assert "s3cret" not in write_report(tmp_path).read_text()


def test_env_option_the_manifest_cannot_hold_is_refused_at_load():
    """A TOML date in ``env.options`` is refused when the job is loaded, naming ``env.options``, not after
    the run directory was made (``write_manifest``: "date is not JSON serializable")."""
    with pytest.raises(config_mod.ConfigError, match=r"env\.options"):
        config_mod.load(None, ["env.options={since = 2024-01-01}"])
