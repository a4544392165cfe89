"""Every Redis key Libra uses, in one place.

All of a job's keys share the hash tag ``{job}`` so that a Redis Cluster keeps
them on one shard (MULTI/EXEC across a job's streams needs that). Nothing else
in the code base spells a key: callers take a ``JobKeys`` and read attributes.
"""

from __future__ import annotations

from dataclasses import dataclass

# Names that become keys are checked where the config checks them (common to every plane).
from pipeline.config import BadName as BadName
from pipeline.config import check_name, check_path as check_path

PREFIX = "libra"
JOBS = f"{PREFIX}:jobs"  # set of job names that have run on this Redis

# The stages whose workers hold slots and that the controller moves between; each reads one stream.
ROLES = ("rollout", "reward", "learner")

# Consumer group of each stage, one per input stream.
GROUP_ROLLOUT = "rollout"
GROUP_REWARD = "reward"
GROUP_LEARNER = "learner"

# Consumer name of a job's one learner: stable across restarts, so a restarted learner replays its own pending list.
LEARNER = "learner-0"


@dataclass(frozen=True)
class JobKeys:
    job: str

    def __post_init__(self):
        check_name("job name", self.job)

    def _k(self, suffix: str) -> str:
        return f"{PREFIX}:{{{self.job}}}:{suffix}"

    @property
    def pattern(self) -> str:  # SCAN MATCH pattern of every key of this job (reset_job deletes them)
        return self._k("*")

    # --- the trajectory buffer: feeder -> rollout -> reward -> learner
    @property
    def prompts(self) -> str:  # feeder -> rollout, one entry per prompt (a GRPO group to be)
        return self._k("prompts")

    @property
    def rollouts(self) -> str:  # rollout -> reward, one entry per generated group
        return self._k("rollouts")

    @property
    def scored(self) -> str:  # reward -> learner, one entry per scored group
        return self._k("scored")

    @property
    def dead_letters(self) -> str:  # any stage -> operators; never trimmed automatically
        return self._k("dlq")

    @property
    def dead_letters_purged(self) -> str:  # what ``libra-ctl dlq purge`` dropped: each record less its payload
        return self._k("dlq:purged")

    # --- policy versions and job state
    @property
    def policy(self) -> str:  # hash: version, path, step, published_at (written by the learner)
        return self._k("policy")

    @property
    def publish(self) -> str:  # hash: every, at, reason (controller -> learner: steps per published version)
        return self._k("publish")

    @property
    def lineage(self) -> str:  # hash: first version of a line -> JSON {updates, parent} (the learner; dataplane.lineage)
        return self._k("lineage")

    @property
    def issued(self) -> str:  # set of prompt ids the feeder issued (the audit's record of what to account for)
        return self._k("issued")

    @property
    def state(self) -> str:  # hash: phase (running|trained|stopping|done|stopped), run_dir, started_at
        return self._k("state")

    @property
    def counters(self) -> str:  # hash of monotonic counts: issued, generated, scored, trained, ...
        return self._k("counters")

    @property
    def learner_stats(self) -> str:  # hash: the learner's last step (reward mean, staleness, ...)
        return self._k("learner:stats")

    @property
    def learner_attempts(self) -> str:  # hash: scored entry id -> JSON {n, error}: training raised on it (learner)
        return self._k("learner:attempts")

    @property
    def learner_training(self) -> str:  # hash: scored entry id -> "step"|"probe": in the learner's hands now
        return self._k("learner:training")

    @property
    def learner_suspects(self) -> str:  # hash: scored entry id -> the learner deaths while it was probed alone
        return self._k("learner:suspects")

    @property
    def workers(self) -> str:  # hash: worker id -> JSON (role, pid, node, slots, state, rate)
        return self._k("workers")

    @property
    def feeder(self) -> str:  # hash: cursor (next prompt index), epoch
        return self._k("feeder")

    # --- held-out evaluation, run by a rollout worker between groups
    @property
    def eval_requests(self) -> str:  # stream: {tag, min_version} (run orchestrator -> rollout)
        return self._k("eval:requests")

    @property
    def eval_results(self) -> str:  # stream: {tag, version, success_rate, samples}
        return self._k("eval:results")

    def eval_claim(self, request_id: str) -> str:  # SET NX: one rollout worker runs a request
        return self._k(f"eval:claim:{request_id}")

    @property
    def eval_served(self) -> str:  # set: the eval claims whose result is written (never run again)
        return self._k("eval:served")

    def seen(self, stage: str, group_id: str) -> str:
        """String with a TTL: ``stage`` already wrote its output for this group (exactly-once effect)."""
        return self._k(f"seen:{stage}:{group_id}")

    @property
    def metrics(self) -> str:  # stream capped by length: sampled metrics (not training data)
        return self._k("metrics")

    @property
    def stages(self) -> tuple[tuple[str, str, str], ...]:
        """(stage name, input stream, consumer group) in pipeline order."""
        return (
            ("rollout", self.prompts, GROUP_ROLLOUT),
            ("reward", self.rollouts, GROUP_REWARD),
            ("learner", self.scored, GROUP_LEARNER),
        )

    # --- observability (owned by pipeline/observe/metrics.py) -----------------------------------------
    # The learner's per-step lines go to ``metrics`` above (kind "learner_step"); the sampler's
    # periodic samples of the four metric kinds go here. Both are capped by length: not training data.
    @property
    def metric_samples(self) -> str:  # stream: {"data": JSON sample} (MetricsSampler -> top, doctor, /metrics)
        return self._k("metrics:samples")

    # --- elastic allocation (pipeline/control/, pipeline/sim/worker.py) --------------------------------
    @property
    def allocation(self) -> str:  # hash: mode (auto|pinned), pinned, target, changed_at, changed_from (controller, scale)
        return self._k("allocation")

    @property
    def placement(self) -> str:  # hash: worker id -> JSON {role, node, slots}; written by the acting controller only
        return self._k("placement")

    @property
    def control_events(self) -> str:  # stream capped by length: the controller's decisions (libra-ctl events)
        return self._k("control:events")

    @property
    def drain_requests(self) -> str:  # set of worker ids to drain (libra-ctl drain -> controller)
        return self._k("control:drain")

    @property
    def external_drain(self) -> str:  # set of external worker ids asked to drain (controller, drain -> the worker)
        return self._k("control:drain:external")

    @property
    def worker_costs(self) -> str:  # hash: worker id -> JSON cumulative busy/pause/idle seconds, items, tokens
        return self._k("costs")

    @property
    def sim_learner(self) -> str:  # hash: the sim learner's checkpoint (step, version, trained), acked with it
        return self._k("sim:learner")

    @property
    def sim_trained(self) -> str:  # set of group ids the sim learner judged, trained or dropped (copies: duplicates)
        return self._k("sim:trained")


# --- elastic allocation: node agents and the controller ---------------------------------------------
AGENTS = f"{PREFIX}:agents"  # hash: node -> JSON {node, host, pid, slots, heartbeat} (each agent)
CONTROLLER_LEASE = f"{PREFIX}:controller:lease"  # string "epoch:token", SET NX PX: the one acting controller
CONTROLLER_EPOCH = f"{PREFIX}:controller:epoch"  # counter, INCR on each lease taken: fences stale actions
CONTROLLER_WAKE = f"{PREFIX}:controller:wake"  # list: a push wakes the controller early (scale, drain)
CONTROL_SEQ = f"{PREFIX}:control:seq"  # counter: every control action takes the next number (ordering)


def agent_lock(node: str) -> str:  # string, SET NX PX: one live agent per node name
    return f"{PREFIX}:agent:{node}:lock"


def agent_queue(node: str) -> str:
    """Name of a node agent's rq queue (rq adds its own ``rq:queue:`` prefix)."""
    return f"libra-agent-{node}"


def agent_desired(node: str) -> str:  # hash: "job/worker" -> JSON spec with state run|drain (control jobs)
    return f"{PREFIX}:agent:{node}:desired"


def agent_procs(node: str) -> str:  # hash: "job/worker" -> JSON {pid, start, slots, state, ...} (the agent)
    return f"{PREFIX}:agent:{node}:procs"


def agent_backoff(node: str) -> str:  # hash: "job/worker" -> JSON {restarts, next_at, run_dir} of a crash
    return f"{PREFIX}:agent:{node}:backoff"


def agent_log(node: str) -> str:  # stream capped by length: every process the agent started or stopped
    return f"{PREFIX}:agent:{node}:log"


def job_pattern(job_glob: str) -> str:
    """SCAN MATCH pattern of every key of the jobs whose names match ``job_glob`` (e.g. ``bench-streams-*``).

    The one place a glob is meant: built here, never from a JobKeys (whose job names hold none).
    """
    return f"{PREFIX}:{{{job_glob}}}:*"


def txn_mark(key: str, token: str) -> str:
    """String, SET with a TTL inside a transaction: that transaction has run (``streams.execute_once``).

    It takes the hash tag of ``key`` (a key the transaction writes), so that a
    Redis Cluster keeps the mark on the shard of the transaction's keys.
    """
    start, end = key.find("{"), key.find("}")
    tag = key[start:end + 1] if 0 <= start < end else "{txn}"
    return f"{PREFIX}:{tag}:txn:{token}"
