import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config as c


def test_defaults_and_overrides():
    cfg = c.load(None, ["learner.lr=1e-4", "job.name=demo", "rollout.group_size=4", "learner.batch_size=64"])
    assert cfg.learner.lr == 1e-4 and cfg.job.name == "demo" and cfg.rollout.group_size == 4
    with pytest.raises(Exception):
        cfg.learner.lr = 1.0  # frozen


def test_synchronous_and_objective_settings_load():
    cfg = c.load("examples/quickstart.toml", ["learner.max_staleness=0", "learner.mini_batches=4",
                                              "learner.advantage=dr_grpo", "learner.dynamic_sampling=true"])
    assert (cfg.learner.max_staleness, cfg.learner.publish_every, cfg.learner.objective) == (0, 1, "decoupled")


def test_quickstart_config_loads():
    cfg = c.load("examples/quickstart.toml")
    assert cfg.learner.batch_size % cfg.rollout.group_size == 0


@pytest.mark.parametrize("override,needle", [
    (["learner.batch_size=100"], "learner.batch_size"),
    (["learner.nope=1"], "unknown key 'learner.nope'"),
    (["learner.lr='fast'"], "learner.lr"),
    (["learner.publish_every=9"], "learner.publish_every"),
    (["redis.url=http://x"], "redis.url"),
    (["rollout.temperature=0"], "rollout.temperature"),
    (["job.steps=-3"], "job.steps"),
    (["oops"], "expected dotted.key=value"),
    (["learner.max_staleness=-1"], "learner.max_staleness"),
    (["learner.max_staleness=0", "learner.publish_every=2"], "learner.publish_every"),
    (["learner.objective=ppo"], "learner.objective"),
    (["learner.objective=behaviour", "learner.mini_batches=2"], "anchored at the weights before the update"),
    (["learner.mini_batches=100"], "more than the batch's groups"),
    (["learner.is_cap=0.5"], "learner.is_cap"),
    (["learner.is_mask=1"], "learner.is_mask"),
    (["learner.advantage=rloo"], "learner.advantage"),
    (["tracking.wandb=yes"], "tracking.wandb"),
    (["streams.backlog_batches=-1"], "streams.backlog_batches"),
    # a learner rank's entries stay pending until its checkpoint: reclaiming them sooner hands a live rank's
    # step to another (10 x 120 s + 60 s = 1260 s here)
    (["learner.checkpoint_every=10", "learner.step_budget_s=120", "learner.checkpoint_write_s=60",
      "streams.learner_min_idle_s=1200"], "1260s"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(c.ConfigError) as exc:
        c.load(None, override)
    assert needle in str(exc.value)


def test_malformed_config_file_exits_2_and_names_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner]\nbatch_sise = 64\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "learner.batch_sise" in proc.stderr
    bad.write_text("[learner\n")
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not valid TOML" in proc.stderr


def test_the_readme_lists_every_config_key_as_the_code_documents_it():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("```text", 1)[1].split("```", 1)[0]
    assert block.strip() == c.reference().strip(), "README's config reference is stale: paste libra-ctl config --reference"


def test_config_reference_lists_every_field_of_every_section():
    """``libra-ctl config --reference`` names each key of the typed tree, under its section, with a meaning.

    The sections and their fields come from the dataclasses' own type hints, not from the reference's code,
    so a key the reference leaves out (or puts under the wrong section) fails here."""
    import dataclasses
    import typing

    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "config", "--reference"], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    listed: dict[str, dict[str, str]] = {}
    section = None
    for line in out.stdout.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = listed.setdefault(line[1:-1], {})
        elif line.startswith("- `"):
            key, _eq, rest = line[3:].partition("` = `")
            section[key] = rest.partition("`: ")[2]
    hints = typing.get_type_hints(c.Config)
    expected = {s.name: [f.name for f in dataclasses.fields(hints[s.name])] for s in dataclasses.fields(c.Config)}
    assert list(listed) == list(expected)
    for name, keys in expected.items():
        missing = [k for k in keys if k not in listed[name]]
        assert not missing, f"[{name}] keys missing from config --reference: {missing}"
        assert all(listed[name][k].strip() for k in keys), f"[{name}] a key without its meaning"
