"""A job's Redis state as a whole: reset before a new run, so a run starts from empty streams
and with none of an earlier run's workers desired on the agents.

Called by ``libra-ctl run`` (``pipeline.run``) and by the sim backend's
``prepare_sim_run`` before a run's first write; ``clear_job`` also by the
streams benchmark, which runs throwaway jobs.
"""

from __future__ import annotations

import json
import os
import socket

import redis

from pipeline.dataplane.keys import AGENTS, JobKeys, agent_desired


class JobRunning(RuntimeError):
    """Another live run owns the job name."""


# phases whose owner, while alive, holds the job name; stopping: its owner is still stopping its workers, who
# write into these keys until they are down; starting: a run between its reset and its first step's state
LIVE_PHASES = (b"starting", b"running", b"trained", b"stopping")


def reset_job(r: redis.Redis, keys: JobKeys) -> None:
    """A new run of a job starts from empty streams; JobRunning if another run of it is live.

    The check, the delete and the claim are one transaction (WATCH on the
    job's state): the job is left in phase ``starting``, owned by this
    process, so a second run of the name started meanwhile is refused until
    this one's owner exits (the run then writes its own state over it)."""
    def reset(pipe) -> None:
        state = pipe.hgetall(keys.state)
        if state.get(b"phase") in LIVE_PHASES and live_owner(state) and not our_claim(state):
            raise JobRunning(f"job {keys.job!r} belongs to a live run (phase {state[b'phase'].decode()}, pid "
                             f"{state[b'pid'].decode()} on {state[b'host'].decode()}); stop it or choose another "
                             f"job.name")
        doomed = list(pipe.scan_iter(match=keys.pattern, count=1000))
        pipe.multi()
        if doomed:
            pipe.delete(*doomed)
        pipe.hset(keys.state, mapping={"phase": "starting", "pid": os.getpid(), "host": socket.gethostname()})

    r.transaction(reset, keys.state)
    forget_desired_workers(r, keys.job)


def our_claim(state: dict) -> bool:
    """Whether a job's state is ``reset_job``'s claim made by this process (phase starting, our pid and host)."""
    return (state.get(b"phase") == b"starting" and state.get(b"pid") == str(os.getpid()).encode()
            and state.get(b"host") == socket.gethostname().encode())


def release_claim(r: redis.Redis, keys: JobKeys) -> bool:
    """Undo ``reset_job``'s claim when the run that made it ends before it owned the job (its first state):
    the state goes, as the reset left it, if it is still this process's ``starting``. Returns whether it
    went; a Redis error leaves it (this host frees a dead pid's claim; another host waits for it to go)."""
    def release(pipe) -> bool:
        state = pipe.hgetall(keys.state)
        if not our_claim(state):
            return False
        pipe.multi()
        pipe.delete(keys.state)
        return True

    try:
        return r.transaction(release, keys.state, value_from_callable=True)
    except redis.RedisError:
        return False


def forget_desired_workers(r: redis.Redis, job: str) -> int:
    """Delete ``job``'s records from every agent's desired hash; returns how many went.

    Those records are the agents', not the job's, so ``clear_job`` leaves
    them. Left there, an earlier run's worker would come back with the new
    run: the agent starts a record in state run (with the earlier run's
    directory) once the job is running again. With its record gone, the agent
    drains a process of it that still runs. The hashes of agents that are down
    go too (SCAN finds them), so none brings the record back when it returns.
    """
    hashes = {agent_desired(n.decode()) for n in r.hkeys(AGENTS)}
    hashes |= {k.decode() for k in r.scan_iter(match=agent_desired("*"), count=1000)}
    gone = 0
    for name in sorted(hashes):
        fields = [f for f, raw in r.hgetall(name).items() if json.loads(raw).get("job") == job]
        if fields:
            gone += r.hdel(name, *fields)
    return gone


def clear_job(r: redis.Redis, pattern: str) -> None:
    """Delete every key matching ``pattern`` (``JobKeys.pattern`` or ``keys.job_pattern``)."""
    doomed = list(r.scan_iter(match=pattern, count=1000))
    if doomed:
        r.delete(*doomed)


def live_owner(state: dict) -> bool:
    """Whether the process a job's state hash names (pid on host) may still be alive."""
    if state.get(b"host", b"").decode() != socket.gethostname():
        return True  # can't check a pid on another machine: assume it is alive
    try:
        os.kill(int(state[b"pid"]), 0)
        return True
    except (ProcessLookupError, ValueError, KeyError):
        return False
    except PermissionError:
        return True
