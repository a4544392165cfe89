"""Every view shows every job on a Redis, and ``--job`` narrows it to one; ``scale --job J`` touches J alone.

``shared_pool`` lays out two jobs, ``alpha`` and ``beta``, as their processes
and the controller leave them in one Redis: each a real sim run directory and
manifest, its workers (the same names in both jobs, as every job has a
``learner-0``), a backlog, a learner step, sampled metrics, an allocation
record and decision events, all on one agent's four slots. No process runs.
"""

from __future__ import annotations

import json
import re
import time

from prometheus_client.parser import text_string_to_metric_families

from pipeline import cli
from pipeline.control.allocation import get_allocation, pin
from pipeline.control.events import record_event
from pipeline.control.job import load_job
from pipeline.dataplane.keys import AGENTS, JobKeys, agent_procs
from pipeline.observe.doctor import diagnose
from pipeline.observe.prometheus import exposition
from pipeline.observe.report import headline, load_run, pool_lines, render
from pipeline.observe.status import format_status, status
from tests.test_doctor import window
from tests.test_metrics import fake_job, learner_step
from tests.test_sim_workers import sim_job

JOBS = ("alpha", "beta")
SLOTS = {"alpha": {"learner-0": 0, "rollout-n-0": 1}, "beta": {"learner-0": 2, "rollout-n-0": 3}}
TARGET = {"rollout": 1, "reward": 1, "learner": 1}


def shared_pool(r, url: str, tmp_path, control: dict | None = None) -> dict[str, JobKeys]:
    """alpha and beta, running side by side on node n1's four slots (see the module docstring).

    alpha's window says its learner falls behind (its queue rises); beta's is balanced.
    """
    now = time.time()
    r.hset(AGENTS, "n1", json.dumps({"node": "n1", "host": "h", "pid": 1, "started_at": now, "heartbeat": now,
                                     "slots": [{"index": i, "device": None} for i in range(4)]}))
    out = {}
    for job in JOBS:
        run_dir = sim_job(r, url, tmp_path, name=job, control=(control or {}).get(job))
        keys = fake_job(r, job, steps=[learner_step(1)], backlog={"learner": 3} if job == "alpha" else {"rollout": 5})
        r.hset(keys.state, "run_dir", str(run_dir))        # fake_job's state names no run directory
        r.hset(keys.learner_stats, mapping={k: json.dumps(v) for k, v in learner_step(1).items()})
        r.hset(keys.allocation, mapping={"mode": "auto", "target": json.dumps(TARGET), "changed_at": now})
        for worker, slot in SLOTS[job].items():
            r.hset(agent_procs("n1"), f"{job}/{worker}", json.dumps({
                "job": job, "worker": worker, "role": worker.split("-")[0], "slots": [slot], "pid": 4000 + slot,
                "state": "running"}))
        rising = (lambda i: 2 + 2 * i) if job == "alpha" else (lambda i: 2 + (i % 3))
        for s in window(n=12, t0=now - 120, wait=lambda i: 0.0 if job == "alpha" else 0.1, learner_backlog=rising):
            for g in s["resources"]["gpus"]:
                g.update(memory_used_bytes=2**30, memory_total_bytes=2**34)   # what NVML adds (Prometheus reads it)
            r.xadd(keys.metric_samples, {"data": json.dumps(s)})
        out[job] = keys
    # the controller's decisions, interleaved in time: alpha, beta, alpha
    for i, job in enumerate(("alpha", "beta", "alpha")):
        record_event(r, job, {"at": now - 30 + i, "kind": "decision", "mode": "auto", "reason": f"move{i}",
                              "summary": f"{job} decision {i}", "from": TARGET, "to": TARGET, "actions": []})
    return out


# --- status -------------------------------------------------------------------------------------------------


def test_status_shows_every_job_with_its_pool_and_whose_slot_is_whose(r, redis_url, tmp_path):
    shared_pool(r, redis_url, tmp_path)
    st = status(r)
    assert [j["name"] for j in st["jobs"]] == ["alpha", "beta"]
    for j in st["jobs"]:
        assert j["pool"] == {"min_slots": 0, "max_slots": 0, "priority": 1.0}
        assert j["allocation"]["roles"] == {"learner": 1, "rollout": 1}
        assert {w["id"]: w["slots"] for w in j["workers"] if w["managed"] == "agent"} == {
            w: [s] for w, s in SLOTS[j["name"]].items()}
    text = format_status(st)
    assert "job alpha" in text and "job beta" in text
    assert text.count("pool min_slots 0  max_slots the pool  priority 1") == 2
    # each job's slot line names the other job's workers by job: both have a learner-0
    assert "0:learner-0  1:rollout-n-0  2:beta/learner-0  3:beta/rollout-n-0" in text
    assert "0:alpha/learner-0  1:alpha/rollout-n-0  2:learner-0  3:rollout-n-0" in text
    assert [j["name"] for j in status(r, "beta")["jobs"]] == ["beta"]


def test_status_cli_json_lists_both_jobs_and_job_narrows(r, redis_url, tmp_path, capsys):
    shared_pool(r, redis_url, tmp_path)
    assert cli.main(["status", "--json", "--redis", redis_url]) == 0
    assert [j["name"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["alpha", "beta"]
    assert cli.main(["status", "--json", "--job", "alpha", "--redis", redis_url]) == 0
    assert [j["name"] for j in json.loads(capsys.readouterr().out)["jobs"]] == ["alpha"]


def test_a_job_whose_manifest_cannot_be_read_here_shows_its_pool_as_unknown(r, redis_url, tmp_path):
    keys = shared_pool(r, redis_url, tmp_path)
    r.hset(keys["beta"].state, "run_dir", str(tmp_path / "elsewhere"))   # another machine's disk
    st = status(r)
    assert [j["pool"] is None for j in st["jobs"]] == [False, True]
    assert "pool unknown (the job's manifest is not readable here)" in format_status(st)


def test_a_pinned_jobs_slots_are_shown_outside_the_pool(r, redis_url, tmp_path, capsys):
    shared_pool(r, redis_url, tmp_path)
    pin(r, "beta", {"rollout": 1, "learner": 1})
    text = format_status(status(r))
    assert text.splitlines()[0] == ("slots 4 on live agents; pinned beta holds 2, outside the pool; "
                                    "the pool of 2 is shared by alpha")
    assert "  pool min_slots 0  max_slots the pool  priority 1\n" in text                     # alpha, in the pool
    assert "  pool none while pinned (it holds its slots outside the pool; min_slots 0" in text   # beta
    assert cli.main(["top", "--once", "--redis", redis_url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("slots 4 on live agents; pinned beta holds 2")
    assert "allocation (pinned)  learner 1  rollout 1   pool none while pinned" in out
    # one job's view has no pool of several jobs to describe
    assert not format_status(status(r, "beta")).startswith("slots")


# --- top ----------------------------------------------------------------------------------------------------


def test_top_draws_a_block_per_job_and_job_keeps_one(r, redis_url, tmp_path, capsys):
    shared_pool(r, redis_url, tmp_path)
    assert cli.main(["top", "--once", "--redis", redis_url]) == 0
    out = capsys.readouterr().out
    assert out.index("libra top  job alpha") < out.index("libra top  job beta")
    blocks = out.split("libra top  job ")[1:]
    assert len(blocks) == 2
    for block in blocks:
        assert "allocation (auto)  learner 1  rollout 1   pool min_slots 0  max_slots the pool  priority 1" in block
    assert "learner        3" in blocks[0] and "rollout        5" in blocks[1]   # each its own stage table
    assert cli.main(["top", "--once", "--job", "beta", "--redis", redis_url]) == 0
    out = capsys.readouterr().out
    assert "libra top  job beta" in out and "job alpha" not in out


# --- events -------------------------------------------------------------------------------------------------


def test_events_merge_every_jobs_decisions_by_time_each_naming_its_job(r, redis_url, tmp_path, capsys):
    shared_pool(r, redis_url, tmp_path)
    assert cli.main(["events", "--redis", redis_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert [line.split()[1] for line in lines] == ["alpha", "beta", "alpha"]
    assert [line.split()[-1] for line in lines] == ["0", "1", "2"]            # the summaries, oldest first
    assert cli.main(["events", "--json", "-n", "2", "--redis", redis_url]) == 0
    newest = json.loads(capsys.readouterr().out)
    assert [(e["job"], e["reason"]) for e in newest] == [("beta", "move1"), ("alpha", "move2")]
    assert cli.main(["events", "--json", "--job", "alpha", "--redis", redis_url]) == 0
    assert [e["reason"] for e in json.loads(capsys.readouterr().out)] == ["move0", "move2"]


def test_a_job_name_that_is_not_on_the_redis_is_refused_naming_those_that_are(r, redis_url, tmp_path, capsys):
    shared_pool(r, redis_url, tmp_path)
    for argv in (["events", "--job", "gamma"], ["scale", "rollout=2", "--job", "gamma"]):
        assert cli.main([*argv, "--redis", redis_url]) == 2   # bad input
        assert "no job 'gamma' on this Redis; its jobs: alpha, beta" in capsys.readouterr().err
    assert not r.exists(JobKeys("gamma").allocation)


# --- scale --------------------------------------------------------------------------------------------------


def test_scale_pins_the_named_job_and_leaves_the_other_untouched(r, redis_url, tmp_path):
    keys = shared_pool(r, redis_url, tmp_path)
    before = r.hgetall(keys["beta"].allocation)
    assert cli.main(["scale", "rollout=2", "learner=1", "--job", "alpha", "--redis", redis_url]) == 0
    alpha = get_allocation(r, "alpha")
    assert alpha["mode"] == "pinned" and alpha["pinned"] == {**TARGET, "rollout": 2}
    assert r.hgetall(keys["beta"].allocation) == before
    assert cli.main(["scale", "--auto", "--job", "alpha", "--redis", redis_url]) == 0
    assert get_allocation(r, "alpha")["mode"] == "auto" and r.hgetall(keys["beta"].allocation) == before


def test_scale_without_job_refuses_while_several_run_and_names_them(r, redis_url, tmp_path, capsys):
    keys = shared_pool(r, redis_url, tmp_path)
    before = {j: r.hgetall(k.allocation) for j, k in keys.items()}
    assert cli.main(["scale", "rollout=2", "--redis", redis_url]) == 2
    assert "several jobs run: alpha, beta; name one with --job J" in capsys.readouterr().err
    assert {j: r.hgetall(k.allocation) for j, k in keys.items()} == before
    r.hset(keys["beta"].state, "phase", "done")              # one job left running: it is the one meant
    assert cli.main(["scale", "rollout=2", "--redis", redis_url]) == 0
    assert get_allocation(r, "alpha")["pinned"]["rollout"] == 2
    assert r.hgetall(keys["beta"].allocation) == before["beta"]


# --- doctor -------------------------------------------------------------------------------------------------


def test_doctor_diagnoses_every_running_job(r, redis_url, tmp_path, capsys):
    shared_pool(r, redis_url, tmp_path)
    assert cli.main(["doctor", "--redis", redis_url, "--sample-s", "0"]) == 1   # alpha has a finding
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "libra-ctl doctor: 2 jobs (alpha: learner; beta: balanced)"
    assert "libra-ctl doctor: job alpha" in text and "libra-ctl doctor: job beta" in text
    assert cli.main(["doctor", "--json", "--redis", redis_url, "--sample-s", "0"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["healthy"] is False
    assert [(j["job"], j["source"], j["bottleneck"]) for j in doc["jobs"]] == [("alpha", "live", "learner"),
                                                                            ("beta", "live", None)]
    assert cli.main(["doctor", "--json", "--job", "beta", "--redis", redis_url, "--sample-s", "0"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["job"] == "beta" and one["healthy"] and "jobs" not in one   # one job: the shape it always had


def _suggested_scale(text: str) -> list[str]:
    """The ``libra-ctl scale ...`` command line an action prints, as argv, with N filled in."""
    found = re.search(r"libra-ctl (scale(?: --job \S+)? \w+=N)", text)
    assert found, text
    return found.group(1).replace("=N", "=2").split()


def test_doctors_scale_advice_names_the_job_while_several_run_and_scale_takes_it(r, redis_url, tmp_path, capsys):
    keys = shared_pool(r, redis_url, tmp_path)
    for argv in ([], ["--job", "alpha"]):       # --job narrows the diagnosis, not the advice's need for it
        assert cli.main(["doctor", *argv, "--redis", redis_url, "--sample-s", "0"]) == 1
        advice = _suggested_scale(capsys.readouterr().out)
        assert advice == ["scale", "--job", "alpha", "learner=2"]
    assert cli.main([*advice, "--redis", redis_url]) == 0
    assert get_allocation(r, "alpha")["pinned"]["learner"] == 2
    assert get_allocation(r, "beta")["mode"] == "auto"
    r.hset(keys["beta"].state, "phase", "done")               # alpha runs alone: the plain command is accepted
    assert cli.main(["doctor", "--redis", redis_url, "--sample-s", "0"]) == 1
    assert _suggested_scale(capsys.readouterr().out) == ["scale", "learner=2"]


def test_every_scale_advice_of_the_doctor_carries_the_command_it_is_given():
    rollout_short = diagnose(window(wait=lambda i: 0.6), scale="libra-ctl scale --job beta")
    assert rollout_short.codes() == ["rollout_short"]
    assert "libra-ctl scale --job beta rollout=N" in rollout_short.primary.action
    learner_short = diagnose(window(learner_backlog=lambda i: 2 + 2 * i), scale="libra-ctl scale --job beta")
    assert learner_short.codes() == ["learner_short"]
    assert "libra-ctl scale --job beta learner=N" in learner_short.primary.action
    assert "shared pool" not in learner_short.primary.action        # no config: nothing known of its mode
    # a job the pool steers: the advice says scale takes it out of the pool, and what keeps it in
    auto = {"control": {"mode": "auto"}}
    pooled = diagnose(window(wait=lambda i: 0.6), config=auto, scale="libra-ctl scale --job beta")
    assert "leaves the pool's sharing" in pooled.primary.action and "control.priority" in pooled.primary.action
    assert "shared pool" not in diagnose(window(wait=lambda i: 0.6), config=auto).primary.action   # alone


def test_doctor_samples_every_unrecorded_job_in_the_same_seconds(r, redis_url, tmp_path, capsys):
    keys = shared_pool(r, redis_url, tmp_path)
    for k in keys.values():
        r.delete(k.metric_samples)                          # no sampler ran
    assert cli.main(["doctor", "--json", "--redis", redis_url, "--sample-s", "1"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert [j["job"] for j in doc["jobs"]] == ["alpha", "beta"]
    assert all(j["window"]["samples"] >= 3 for j in doc["jobs"])
    assert all(r.xlen(k.metric_samples) == 0 for k in keys.values())   # taken, not recorded


# --- Prometheus ---------------------------------------------------------------------------------------------


def scrape(r, jobs=None) -> list:
    return [s for fam in text_string_to_metric_families(exposition(r, jobs)) for s in fam.samples]


def test_prometheus_exports_every_jobs_series_each_with_its_job_label(r, redis_url, tmp_path):
    shared_pool(r, redis_url, tmp_path)
    samples = scrape(r)
    assert samples and all("job" in s.labels for s in samples)
    by_job = lambda name: {s.labels["job"]: s.value for s in samples if s.name == name}
    assert by_job("libra_policy_version") == {"alpha": 1, "beta": 1}
    assert by_job("libra_job_min_slots") == {"alpha": 0, "beta": 0}
    assert by_job("libra_job_max_slots") == {"alpha": 0, "beta": 0}
    assert by_job("libra_job_priority") == {"alpha": 1.0, "beta": 1.0}
    lengths = {(s.labels["job"], s.labels["stage"]): s.value for s in samples if s.name == "libra_stream_length"}
    assert lengths[("alpha", "learner")] == 3 and lengths[("beta", "rollout")] == 5
    # every family the one-job exposition has, each job has too
    names = lambda job: {s.name for s in samples if s.labels["job"] == job}
    assert names("alpha") == names("beta")
    assert {s.labels["job"] for s in scrape(r, ["beta"])} == {"beta"}


# --- the report ---------------------------------------------------------------------------------------------


def test_the_report_headline_gives_the_jobs_pool_settings(r, redis_url, tmp_path):
    keys = shared_pool(r, redis_url, tmp_path)
    run_dir = r.hget(keys["alpha"].state, "run_dir").decode()
    rows = dict(headline(load_run(run_dir)))
    assert rows["job"] == "alpha" and rows["pool"] == "min_slots 0  max_slots the pool  priority 1"


def test_each_views_pool_settings_are_the_jobs_own(r, redis_url, tmp_path, capsys):
    control = {"alpha": {"min_slots": 2, "max_slots": 3, "priority": 2.0}, "beta": {"min_slots": 1}}
    keys = shared_pool(r, redis_url, tmp_path, control=control)
    st = status(r)
    assert [j["pool"] for j in st["jobs"]] == [{"min_slots": 2, "max_slots": 3, "priority": 2.0},
                                              {"min_slots": 1, "max_slots": 0, "priority": 1.0}]
    assert "pool min_slots 2  max_slots 3  priority 2" in format_status(st)
    assert cli.main(["top", "--once", "--redis", redis_url]) == 0
    assert "pool min_slots 1  max_slots the pool  priority 1" in capsys.readouterr().out
    samples = scrape(r)
    assert {s.labels["job"]: s.value for s in samples if s.name == "libra_job_priority"} == {"alpha": 2.0,
                                                                                             "beta": 1.0}
    run_dir = r.hget(keys["alpha"].state, "run_dir").decode()
    assert dict(headline(load_run(run_dir)))["pool"] == "min_slots 2  max_slots 3  priority 2"


def test_the_report_headline_of_a_job_configured_pinned_puts_it_outside_the_pool(r, redis_url, tmp_path):
    keys = shared_pool(r, redis_url, tmp_path, control={"beta": {"mode": "pinned", "min_slots": 1}})
    run_dir = r.hget(keys["beta"].state, "run_dir").decode()
    assert dict(headline(load_run(run_dir)))["pool"] == (
        "none while pinned (it holds its slots outside the pool; min_slots 1  max_slots the pool  priority 1 "
        "once back on auto)")


def test_the_report_says_who_shared_the_pool_this_jobs_share_the_moves_and_when_it_was_below_its_minimum(
        r, redis_url, tmp_path):
    keys = shared_pool(r, redis_url, tmp_path, control={"alpha": {"min_slots": 2}})
    alpha = load_job(r, "alpha")            # a JobInfo: record_event also writes alpha's events.jsonl, as the loop does
    now = time.time()
    pools = [(now - 50, "fit", {"alpha": 1, "beta": 3}, 0, ["alpha"]),          # the pool shrank below 3 minimums
             (now - 40, "guarantee", {"alpha": 2, "beta": 2, "gamma": 0}, 1, []),
             (now - 20, "rebalance_jobs", {"alpha": 3, "beta": 1}, 1, []),
             (now - 10, "fit", {"alpha": 1, "beta": 1}, 0, ["alpha", "beta"])]
    for at, reason, shares, moved, below in pools:
        record_event(r, alpha, {"at": at, "kind": "decision", "mode": "auto", "reason": "split", "from": TARGET,
                                "to": TARGET, "actions": [],
                                "pool": {"reason": reason, "shares": shares, "share": shares["alpha"],
                                         "moved_between_jobs": moved, **({"below_min": below} if below else {})}})
    d = load_run(alpha.run_dir)
    start, end = d.x(now - 50), d.x(now - 40)
    assert pool_lines(d) == [
        "shared with beta (1–3 slots), gamma (0 slots)",
        "this job's share: 1–3 slots over 4 decisions (last 1)",
        "slots moved between jobs: 2, in 2 of its decisions",
        "below its minimum (min_slots 2; the pool was smaller than the minimums' sum): "
        f"{start:.0f}–{end:.0f} s, {d.x(now - 10):.0f} s–end"]
    page = render(d)
    assert "<h2>Pool</h2>" in page and "shared with beta (1–3 slots)" in page
    # beta's run directory has no decision with a pool (its events went to Redis alone): no section
    beta = load_run(r.hget(keys["beta"].state, "run_dir").decode())
    assert pool_lines(beta) == [] and "<h2>Pool</h2>" not in render(beta)
