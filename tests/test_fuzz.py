"""Fuzzing of every loader of outside input: no crash, only the loader's own clean error.

Property-based (hypothesis) and raw-bytes fuzzing of

- the message decoder (``pipeline.dataplane.messages.decode``): ``BadMessage``;
- the config loader (``pipeline.config.load``: TOML text and ``--set``
  overrides): ``ConfigError``;
- the prompt loader (``Environment.read_prompts``, what the feeder and the
  evaluator read prompt files with): a ``Task`` or a ``BadLine`` per line;
- the workload loader (``pipeline.sim.workload.load_workload``):
  ``WorkloadError``.

Valid inputs round-trip. Every test fixes ``max_examples`` and runs
derandomized (the same cases on every run); they add up to 14,500 cases
(``CASES``), which the last test checks were all run and prints.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import config as config_mod
from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import JobKeys
from pipeline.sim.workload import WorkloadError, load_workload, parse_workload
from workers.envs import load_env
from workers.envs.base import BadLine, Environment, Task

ROOT = Path(__file__).resolve().parent.parent
# cases run by this module's tests, checked and printed by the last one (one process: scripts/test runs
# pytest-xdist with --dist loadfile, which keeps a module on one worker, in order)
CASES = {"run": 0}


def fuzz(n: int):
    """Hypothesis settings of one fuzz test: ``n`` cases, derandomized, no example database."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])


def count() -> None:
    CASES["run"] += 1


# Any msgpack-able value, nested a little.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


# --- the message decoder ------------------------------------------------------------------------


def decodes_cleanly(payload: bytes):
    """The decoded message, or None after a BadMessage with a reason; a decoded message's numbers are finite."""
    try:
        msg = m.decode(payload, 1 << 20)
    except m.BadMessage as exc:
        assert exc.reason
        return None
    floats = [msg.issued_at] if isinstance(msg, m.Prompt) else [msg.generated_at, msg.gen_s, msg.scored_at or 0.0]
    for t in getattr(msg, "trajectories", ()):
        floats += [*t.tool_latency_s, t.reward or 0.0, *t.logprobs.tolist()]
    assert all(math.isfinite(x) for x in floats), msg
    return msg


@fuzz(3000)
@given(st.binary(max_size=600))
def test_decoder_raw_bytes(payload):
    count()
    decodes_cleanly(payload)


def trajectory(n: int, idx: int, reward) -> m.Trajectory:
    rng = np.random.default_rng(n * 31 + idx)
    return m.Trajectory(sample_idx=idx, completion=rng.integers(0, 1 << 20, n).astype(np.int32),
                        mask=rng.integers(0, 2, n).astype(np.uint8), logprobs=-rng.random(n).astype(np.float32),
                        text="t" * n, finish="answer", turns=1, tool_calls=0, tool_latency_s=(0.5,) * (n % 3),
                        tool_timeouts=0, reward=reward)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 63, 2 ** 63 - 1),
                                     st.floats(allow_nan=False), st.text(max_size=10)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=8)


@st.composite
def groups(draw) -> m.Group:
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    scored = draw(st.booleans())
    rewards = [draw(st.floats(-1e6, 1e6)) if scored else None for _ in sizes]
    return m.Group(prompt_id=draw(st.text(min_size=1, max_size=20)), prompt=draw(st.text(max_size=50)),
                   answer=draw(json_values), prompt_tokens=np.arange(draw(st.integers(0, 30)), dtype=np.int32),
                   version=draw(st.integers(0, 2 ** 31)), worker="rollout-0",
                   generated_at=draw(st.floats(0, 2e9)), gen_s=draw(st.floats(0, 1e4)),
                   trajectories=tuple(trajectory(n, i, r) for i, (n, r) in enumerate(zip(sizes, rewards))),
                   scored_at=1.0 if scored else None, extra={"gen_tokens": sum(sizes)})


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (m.Group, m.Trajectory, m.Prompt)):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@fuzz(500)
@given(st.one_of(groups(), st.builds(m.Prompt, st.text(max_size=20), st.text(max_size=50), json_values,
                                     st.floats(0, 2e9))))
def test_decoder_valid_messages_round_trip(msg):
    count()
    assert same(m.decode(m.encode(msg), 1 << 24), msg)


@fuzz(2000)
@given(groups(), st.data())
def test_decoder_mutated_fields(group, data):
    """A valid group's map (or one of its trajectories' maps) with a field replaced, removed or added."""
    count()
    body = msgpack.unpackb(m.encode(group), raw=False)
    target = body
    if data.draw(st.booleans()):
        target = body["trajectories"][data.draw(st.integers(0, len(body["trajectories"]) - 1))]
    key = data.draw(st.sampled_from(sorted(target) + ["junk"]))
    action = data.draw(st.sampled_from(["set", "delete"]))
    if action == "delete":
        target.pop(key, None)
    else:
        target[key] = data.draw(values)
    decodes_cleanly(msgpack.packb(body, use_bin_type=True))


# --- the config loader --------------------------------------------------------------------------

KEYS = [(sec.name, f.name) for sec in fields(config_mod.Config) for f in fields(sec.default_factory)]


def toml_literal(v) -> str:
    """``v`` as a TOML value (nan and inf included); strings as JSON strings, which TOML reads."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_literal(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


toml_values = st.recursive(
    st.one_of(st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True, allow_infinity=True),
              st.text(max_size=30)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def loads_cleanly(path, overrides=()):
    try:
        cfg = config_mod.load(path, list(overrides))
    except config_mod.ConfigError as exc:
        assert str(exc)
        return None
    # A config that loads is one the workers can load again from the manifest, and its numbers make sense.
    assert config_mod.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for sec in fields(cfg):
        for f in fields(getattr(cfg, sec.name)):
            v = getattr(getattr(cfg, sec.name), f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                assert math.isfinite(v) and 0 <= v < 2 ** 63, f"{sec.name}.{f.name} = {v}"
    JobKeys(cfg.job.name)   # a job name that makes valid keys
    return cfg


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@fuzz(1500)
@given(st.binary(max_size=400))
def test_config_raw_bytes(scratch, raw):
    count()
    path = scratch / "job.toml"
    path.write_bytes(raw)
    loads_cleanly(path)


@fuzz(1500)
@given(st.dictionaries(st.sampled_from(KEYS), toml_values, max_size=5), st.sampled_from([None, "zzz"]))
def test_config_typed_tables(scratch, table, junk_section):
    """Known keys (and an unknown section) with values of every type, nan and inf included."""
    count()
    by_section: dict[str, list[str]] = {}
    for (sec, key), v in table.items():
        by_section.setdefault(sec, []).append(f"{key} = {toml_literal(v)}")
    if junk_section:
        by_section[junk_section] = ["x = 1"]
    text = "\n".join(f"[{sec}]\n" + "\n".join(lines) for sec, lines in by_section.items())
    path = scratch / "typed.toml"
    path.write_text(text)
    loads_cleanly(path)


override_keys = st.one_of(st.sampled_from([f"{s}.{k}" for s, k in KEYS]), st.text(max_size=20))
override_values = st.one_of(toml_values.map(toml_literal), st.text(max_size=30))


@fuzz(1500)
@given(st.lists(st.tuples(override_keys, st.sampled_from(["=", "", "=="]), override_values), max_size=4))
def test_config_set_overrides(items):
    count()
    loads_cleanly(None, [f"{k}{sep}{v}" for k, sep, v in items])


def test_config_defaults_and_examples_round_trip():
    for path in [None, ROOT / "examples" / "quickstart.toml", ROOT / "examples" / "guess.toml"]:
        assert loads_cleanly(path) is not None


# --- the prompt loader --------------------------------------------------------------------------

ENVS = {"default": Environment(), "calc": load_env("calc"), "guess": load_env("guess")}


def reads_cleanly(env: Environment, path: Path) -> list:
    items = list(env.read_prompts(path))
    for item in items:
        assert isinstance(item, (Task, BadLine))
        if isinstance(item, BadLine):
            assert item.reason and item.lineno >= 1
    return items


@fuzz(1500)
@given(st.binary(max_size=400), st.sampled_from(sorted(ENVS)))
def test_prompt_files_raw_bytes(scratch, raw, env):
    count()
    path = scratch / "prompts.jsonl"
    path.write_bytes(raw)
    reads_cleanly(ENVS[env], path)


records = st.one_of(
    values,
    st.fixed_dictionaries({"prompt_id": st.one_of(st.text(max_size=30), values),
                           "prompt": st.one_of(st.text(max_size=30), values)},
                          optional={"answer": st.one_of(json_values, st.integers(-5, 200), st.fixed_dictionaries(
                              {"secret": st.one_of(st.integers(-5, 200), values)},
                              optional={"high": st.one_of(st.integers(-5, 200), values)}))}))


@fuzz(1000)
@given(st.lists(records, max_size=5), st.sampled_from(sorted(ENVS)), st.integers(0, 5000))
def test_prompt_files_structured(scratch, recs, env, depth):
    """JSON records of every shape, one a line, and one nested ``depth`` deep."""
    count()
    lines = [json.dumps(r, default=repr) for r in recs] + ["[" * depth + "]" * depth]
    path = scratch / "structured.jsonl"
    path.write_text("\n".join(lines) + "\n")
    items = reads_cleanly(ENVS[env], path)
    assert len(items) == sum(1 for line in lines if line.strip())


def test_prompt_files_valid_records_round_trip(scratch):
    calc = ENVS["calc"]
    tasks = calc.make_tasks(0, 50, "train")
    path = scratch / "valid.jsonl"
    from workers.envs.base import write_prompt_file

    write_prompt_file(path, tasks)
    assert reads_cleanly(calc, path) == tasks


# --- the workload loader ------------------------------------------------------------------------

WORKLOADS = sorted((ROOT / "examples" / "bench").glob("*.toml"))


@fuzz(1000)
@given(st.binary(max_size=400))
def test_workload_raw_bytes(scratch, raw):
    count()
    path = scratch / "workload.toml"
    path.write_bytes(raw)
    try:
        load_workload(path)
    except WorkloadError as exc:
        assert str(exc)


def walk(d, path=()):
    """Every (path, value) of a nested TOML document, tables and lists of tables included."""
    yield path, d
    if isinstance(d, dict):
        for k, v in d.items():
            yield from walk(v, path + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from walk(v, path + (i,))


@fuzz(1000)
@given(st.sampled_from(WORKLOADS), st.data())
def test_workload_mutated_values(path, data):
    """A bench workload with one value (or table) replaced by a value of any type, or deleted."""
    count()
    import tomllib

    doc = tomllib.loads(path.read_text())
    spots = [p for p, _v in walk(doc) if p]
    where = data.draw(st.sampled_from(spots))
    parent = doc
    for k in where[:-1]:
        parent = parent[k]
    if data.draw(st.booleans()):
        parent[where[-1]] = data.draw(toml_values)
    elif isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent.pop(where[-1])
    try:
        parse_workload(doc, str(path))
    except WorkloadError as exc:
        assert str(exc)


def test_workloads_valid_files_load():
    for path in WORKLOADS:
        assert load_workload(path).name


def test_zz_every_fuzz_case_ran(request, capsys):
    """Runs last: all 14,500 cases ran (when the whole module did), and says how many."""
    ran = CASES["run"]
    with capsys.disabled():
        print(f"\nfuzz: {ran} cases")
    selected = {item.name for item in request.session.items}
    if all(name in selected for name in FUZZ_TESTS):
        assert ran >= 10_000, ran


FUZZ_TESTS = ("test_decoder_raw_bytes", "test_decoder_valid_messages_round_trip", "test_decoder_mutated_fields",
              "test_config_raw_bytes", "test_config_typed_tables", "test_config_set_overrides",
              "test_prompt_files_raw_bytes", "test_prompt_files_structured", "test_workload_raw_bytes",
              "test_workload_mutated_values")
