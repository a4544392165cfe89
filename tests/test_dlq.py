import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.dataplane import messages as m
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys
from pipeline.dataplane.streams import ClaimPolicy, ensure_groups, run_stage
from tests.test_streams import unscored_group

ROOT = Path(__file__).resolve().parent.parent


def ctl(redis_url, *args):
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--job", "t", "--redis", redis_url],
                          cwd=ROOT, capture_output=True, text=True)


def test_dlq_list_show_replay_purge(r, redis_url):
    keys = JobKeys("t")
    ensure_groups(r, keys)
    r.xadd(keys.rollouts, {m.FIELD: b"\x93junk"})
    r.xadd(keys.rollouts, {m.FIELD: m.encode(unscored_group("needs-retry"))})
    fail = {"on": True}
    rounds = []
    run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
              handle=lambda gs: [__import__("pipeline.dataplane.streams").dataplane.streams.Reject("verifier down") if fail["on"]
                                 else g.with_rewards([1.0, 1.0], 0.0) for g in gs],
              count=10, block_ms=20, max_bytes=1 << 20, stop=lambda: rounds.append(1) or len(rounds) > 2,
              claims=ClaimPolicy(60_000, 3))
    listed = ctl(redis_url, "dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)
    assert len(entries) == 2
    junk, retry = entries
    assert junk["reason"].startswith("malformed msgpack") and retry["reason"] == "verifier down"
    shown = json.loads(ctl(redis_url, "dlq", "show", retry["id"]).stdout)
    assert shown["message"]["prompt_id"] == "needs-retry" and shown["source_id"]
    assert "undecodable" in json.loads(ctl(redis_url, "dlq", "show", junk["id"]).stdout)["message"]

    assert ctl(redis_url, "dlq", "replay", retry["id"]).returncode == 0
    assert r.xlen(keys.dead_letters) == 1
    fail["on"] = False
    rounds.clear()
    run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer="reward-0", sink=keys.scored,
              handle=lambda gs: [g.with_rewards([1.0, 1.0], 0.0) for g in gs], count=10, block_ms=20,
              max_bytes=1 << 20, stop=lambda: rounds.append(1) or len(rounds) > 2, claims=ClaimPolicy(60_000, 3))
    assert r.xlen(keys.scored) == 1  # the replayed group went through

    refused = ctl(redis_url, "dlq", "purge", "--all")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    assert ctl(redis_url, "dlq", "purge", "--all", "--yes").returncode == 0
    assert r.xlen(keys.dead_letters) == 0


def test_a_dead_letter_id_given_in_part_is_refused_not_replayed_twice(r):
    """``dlq show|replay|purge <ms>`` (the id without its sequence): Redis reads it as every entry of that
    millisecond. Show used to die on StopIteration, and replay copied the entry it found (``<ms>-1``) then
    deleted ``<ms>-0``, leaving the copied one to be replayed again. Each now asks for the whole id and
    changes nothing; a text that is no id at all is refused the same way."""
    from pipeline.observe.audit import dlq_purge, dlq_replay, dlq_show

    keys = JobKeys("part")
    payload = m.encode(unscored_group("g"))
    r.xadd(keys.dead_letters, {"stream": keys.rollouts, "payload": payload, "trajectories": 2}, id="5000-1")
    for call in (lambda i: dlq_show(r, keys, i), lambda i: dlq_replay(r, keys, [i]),
                 lambda i: dlq_purge(r, keys, [i])):
        for given in ("5000", "not-an-id"):
            with pytest.raises(SystemExit, match="5000-1|not a stream id"):
                call(given)
    assert r.xlen(keys.dead_letters) == 1 and r.xlen(keys.rollouts) == 0
    assert dlq_replay(r, keys, ["5000-1"]) == 1 and r.xlen(keys.dead_letters) == 0
