"""Held-out evaluations served between engine calls, and the episode loop's starts, under faults.

A request whose worker died mid-evaluation is still answered, and no request or
interval is evaluated twice, across workers, restarts and restores; evaluations
retry a failing tool as training does; episodes start concurrently.

No vLLM: the rollout stage is built around the one-turn generator and the char
tokenizer the environment-fault tests use (``tests/test_env_faults.py``), on the
suite's Redis.
"""

from __future__ import annotations

import structlog

from pipeline.dataplane.keys import JobKeys
from tests.test_env_faults import JOB, Replies, _stage
from workers.envs.base import Reply


def _eval_records(r) -> list[tuple[str, int]]:
    return [(f[b"tag"].decode(), int(f[b"version"])) for _i, f in r.xrange(JobKeys(JOB).eval_results)]


class _Crash(RuntimeError):
    pass


class _DiesMidEval:
    """An engine whose process dies in the middle of a generation (an OOM kill, a preemption)."""

    max_model_len = None

    def generate(self, requests, **_kw):
        raise _Crash("engine died")


def _worker(r, worker_id: str, version: int, *sets: str):
    s = _stage(r, Replies(lambda: Reply(done=True, finish="answer")), *sets)
    s.ctx.worker_id, s.ctx.policy_version = worker_id, version
    s.ctx.log = structlog.get_logger()
    s.eval_cursor, s.evaluated_bucket = "0", -1
    return s


# --- held-out evaluation requests -----------------------------------------------------------------------------


def test_a_start_eval_whose_worker_died_mid_eval_is_run_by_the_restarted_worker(r):
    """The run waits for the "start" evaluation (``wait_eval``, 300 s, then RunFailed). The worker that claimed
    it dies mid-evaluation and its agent restarts it under the same stable id: the restarted worker takes
    its claim back and runs it, once. Before, the dead process's claim (``SET NX``, an hour) made every
    worker skip the request and the run failed."""
    keys = JobKeys(JOB)
    r.hset(keys.policy, mapping={"version": 0, "path": "/weights/v0"})
    r.xadd(keys.eval_requests, {"tag": "start", "min_version": 0, "at": 0.0})

    first = _worker(r, "rollout-n-0", 0)
    first.engine = _DiesMidEval()
    try:
        first.serve_eval_requests()
    except _Crash:
        pass   # the process is gone

    restarted = _worker(r, "rollout-n-0", 0)   # same stable id, fresh process: reads the requests from "0"
    restarted.serve_eval_requests()
    other = _worker(r, "rollout-n-1", 0)
    other.serve_eval_requests()
    assert [t for t, _v in _eval_records(r)] == ["start"], \
        f"eval records after the claimant died mid-eval: {_eval_records(r)} (the run waits for 'start')"


def test_an_eval_request_served_once_is_not_served_again_by_a_worker_started_an_hour_later(r):
    """A worker started after the eval claims expired (an hour) reads the requests from the stream's start:
    a request whose result is written is not run again. Before, it was, with the current weights
    (a second "start" record at version 7)."""
    keys = JobKeys(JOB)
    r.hset(keys.policy, mapping={"version": 0, "path": "/weights/v0"})
    r.xadd(keys.eval_requests, {"tag": "start", "min_version": 0, "at": 0.0})
    _worker(r, "rollout-n-0", 0).serve_eval_requests()
    assert _eval_records(r) == [("start", 0)]

    for key in r.scan_iter(match=f"*{JOB}*eval:claim:*"):   # an hour later: the claims have expired
        r.delete(key)
    r.hset(keys.policy, mapping={"version": 7, "path": "/weights/v7"})
    late = _worker(r, "rollout-n-3", 7)
    late.engine.reload = lambda path: None
    late.serve_eval_requests()
    assert _eval_records(r) == [("start", 0)], f"eval records: {_eval_records(r)}"


def test_periodic_evaluation_runs_once_per_eval_every_steps_across_workers(r):
    """``job.eval_every = 10``: one held-out evaluation per ten learner steps. Two workers reload at different
    times, one onto v10 (step 10), the other onto v11 (step 11): one evaluation for steps 10-19. Before, each
    worker claimed its own version and both evaluated (one full greedy pass per worker and interval)."""
    keys = JobKeys(JOB)
    a = _worker(r, "rollout-n-0", 10, "job.eval_every=10", "job.steps=100")
    b = _worker(r, "rollout-n-1", 11, "job.eval_every=10", "job.steps=100")
    r.hset(keys.policy, mapping={"version": 10, "path": "/weights/v10", "step": 10})
    a.maybe_periodic_eval()
    r.hset(keys.policy, mapping={"version": 11, "path": "/weights/v11", "step": 11})
    b.maybe_periodic_eval()
    a.maybe_periodic_eval()   # a, behind the published version, waits for its reload
    assert _eval_records(r) == [("periodic", 10)], f"eval records: {_eval_records(r)}"


def test_periodic_evaluations_go_on_after_a_restore_numbered_versions_past_job_steps(r):
    """``job.steps = 40``, ``eval_every = 5``: the learner restored its step-20 checkpoint under v26 (a
    restore numbers past what was published), so step 39 publishes v45. Its interval (steps 35-39) is
    evaluated; step 40, the last, is left to the run's final evaluation. Before, the version number was
    compared with ``job.steps`` and nothing from v40 on was evaluated."""
    keys = JobKeys(JOB)
    s = _worker(r, "rollout-n-0", 45, "job.eval_every=5", "job.steps=40")
    s.evaluated_bucket = 6   # steps 30-34
    r.hset(keys.policy, mapping={"version": 45, "path": "/weights/v45", "step": 39})
    s.maybe_periodic_eval()
    s.ctx.policy_version = 46
    r.hset(keys.policy, mapping={"version": 46, "path": "/weights/v46", "step": 40})
    s.maybe_periodic_eval()
    assert _eval_records(r) == [("periodic", 45)], f"eval records at steps 39 and 40 of 40: {_eval_records(r)}"


class _FlakyTool(Replies):
    """A tool whose first try of each call raises (a dropped connection), the retry answers. Two model turns:
    the tool's result, then done; the reward is 1 when the result is in the transcript."""

    def __init__(self):
        super().__init__(None)

    def start(self, task):
        return {"tries": 0, "calls": 0}

    def step(self, state, task, turn, finish):
        state["tries"] += 1
        if state["tries"] % 2 == 1:
            raise ConnectionError("tool service dropped the connection")
        state["calls"] += 1
        if state["calls"] == 1:
            return Reply(text="[ok]", tool_call=True)
        return Reply(done=True, finish="answer")

    def reward(self, task, transcript):
        return 1.0 if "[ok]" in transcript else 0.0


def test_a_held_out_evaluation_retries_a_failing_tool_as_training_does(r):
    """``rollout.tool_retries = 2``: a tool call that raises is retried (docs/environments.md, "Tool errors"),
    in the held-out evaluation as in training: success 1.0 over 1 episode. Before, evaluations never
    retried: the first raise ended the episode and its cut-off transcript counted as a 0."""
    from pipeline.dataplane import messages

    s = _stage(r, _FlakyTool(), "rollout.tool_retries=2")
    s.ctx.policy_version = 3
    [group] = s.play([messages.Prompt("p@0", "q:", 1, 0.0)])
    assert isinstance(group, messages.Group), group   # training: retried, the group is whole
    s.run_eval("periodic", claim="v3")
    [(_id, rec)] = r.xrange(JobKeys(JOB).eval_results)
    assert (float(rec[b"success_rate"]), int(rec[b"n"])) == (1.0, 1), \
        f"held-out: success_rate {rec[b'success_rate']!r}, n {rec[b'n']!r}"


# --- the episode loop -------------------------------------------------------------------------------------------


class _StartsAtOnce(Replies):
    """An environment whose ``start`` waits on a service (0.2 s) and counts how many starts run at once."""

    def __init__(self):
        super().__init__(lambda: Reply(done=True, finish="answer"))
        import threading

        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def start(self, task):
        import time

        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.2)
        with self.lock:
            self.now -= 1
        return {}


def test_episode_starts_run_concurrently_like_steps():
    """``env.start`` runs on the step pool, as steps do (a start may build a sandbox, slower than a tool
    call): the 32 starts of an engine call (4 groups of 8) run at once, up to the pool's 16. Before, each
    was waited for in turn (6.4 s here), and a start that hung held the engine call 60 s per episode."""
    from tests.test_env_faults import OneTurn
    from tests.test_envs import CharTokenizer
    from workers.envs.base import STEP_CONCURRENCY, Task
    from workers.episode import run_episodes

    env = _StartsAtOnce()
    items = [(Task(f"p{k}@0", "q:"), i) for k in range(4) for i in range(8)]
    eps = run_episodes(OneTurn(), CharTokenizer(), items, greedy=False, max_turns=2, max_tokens_per_turn=8,
                       tool_timeout_s=2.0, seed=0, env=env)
    assert [e.finish for e in eps] == ["answer"] * 32
    assert env.most >= STEP_CONCURRENCY // 2, f"at most {env.most} starts ran at once"


def test_an_eval_claimed_by_a_worker_that_is_gone_is_taken_over_and_run_once(r):
    """A worker claims the "start" evaluation, then leaves for good (scaled away mid-evaluation: not restarted
    under its id). The others look at a claim held by a live worker again each round, and take one whose
    holder's record says it is gone: the request is answered once. Before, the claim (SET NX, an hour)
    made every other worker skip the request for good, and the run waited for 'start' until it failed."""
    import json
    import time

    keys = JobKeys(JOB)
    r.hset(keys.policy, mapping={"version": 0, "path": "/weights/v0"})
    r.xadd(keys.eval_requests, {"tag": "start", "min_version": 0, "at": 0.0})
    r.set(keys.eval_claim(r.xrange(keys.eval_requests)[0][0].decode()), "rollout-n-9", ex=3600)
    record = {"id": "rollout-n-9", "role": "rollout", "state": "running", "heartbeat": time.time()}
    r.hset(keys.workers, "rollout-n-9", json.dumps(record))

    a, b = _worker(r, "rollout-n-0", 0), _worker(r, "rollout-n-1", 0)
    a.serve_eval_requests()
    b.serve_eval_requests()
    assert _eval_records(r) == [], "a request held by a live worker was run again"

    r.hset(keys.workers, "rollout-n-9", json.dumps({**record, "state": "exited"}))   # it is gone
    a.serve_eval_requests()
    b.serve_eval_requests()
    a.serve_eval_requests()
    assert _eval_records(r) == [("start", 0)], f"eval records: {_eval_records(r)}"


def test_an_eval_finished_by_its_holder_while_another_worker_looks_is_not_run_again(r):
    """The holder of an evaluation writes its result and exits between another worker's look at
    ``eval_served`` and its takeover: the takeover sees the result and runs nothing. Before, it looked only
    at the holder's record (exited), took the claim and evaluated again: two "start" records."""
    import json
    import time

    keys = JobKeys("revep")
    r.hset(keys.policy, mapping={"version": 0, "path": "/weights/v0"})
    r.xadd(keys.eval_requests, {"tag": "start", "min_version": 0, "at": 0.0})
    claim = r.xrange(keys.eval_requests)[0][0].decode()
    r.set(keys.eval_claim(claim), "rollout-n-9", ex=3600)
    record = {"id": "rollout-n-9", "role": "rollout", "state": "running", "heartbeat": time.time()}
    r.hset(keys.workers, "rollout-n-9", json.dumps(record))

    b = _worker(r, "rollout-n-1", 0)
    take = b._take_claim

    def holder_finishes_then_take(c):
        # D, in the window between B's eval_served check and its takeover: result written, then gone
        r.xadd(keys.eval_results, {"tag": "start", "version": 0, "success_rate": 1.0, "n": 1, "unjudged": 0,
                                   "worker": "rollout-n-9", "at": time.time(), "samples": b""})
        r.sadd(keys.eval_served, c)
        r.hset(keys.workers, "rollout-n-9", json.dumps({**record, "state": "exited"}))
        return take(c)

    b._take_claim = holder_finishes_then_take
    b.serve_eval_requests()
    assert _eval_records(r) == [("start", 0)], f"eval records: {_eval_records(r)}"
