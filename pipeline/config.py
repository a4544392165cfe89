"""A job's configuration: one TOML file loaded into a typed, frozen tree.

Called by ``libra-ctl run`` (the orchestrator) and by every worker process,
which reloads the resolved tree from the run's manifest. Unknown keys and bad
values raise ``ConfigError`` naming the key and the fix; the CLI turns that
into exit code 2. ``--set dotted.key=value`` overrides any field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and the fix."""


# --- names that reach keys, key patterns and file names ---------------------------------------------
MAX_NAME_LEN = 128
# Glob characters make a name a SCAN MATCH pattern (reset_job would delete other jobs' keys); braces
# change the hash tag (a job's keys would spread over cluster shards); a path separator or ".." leaves
# the directory a name is a file of (logs/<worker>.jsonl, runs/<id>/).
_GLOB = frozenset("*?[]")
_BRACES = frozenset("{}")
_SEPARATORS = frozenset("/\\")


class BadName(ValueError):
    """A name (job, worker id, run id, ...) that cannot safely become a Redis key or a file name."""


class BadInput(ValueError):
    """An operator's argument that cannot be acted on (an unknown job, a count that is not role=N): exit 2."""


def check_name(kind: str, name, max_len: int = MAX_NAME_LEN) -> str:
    """``name`` if it is safe in a key, a key pattern and a file name; BadName saying what is wrong."""
    if not isinstance(name, str):
        raise BadName(f"{kind} must be a string, not a {type(name).__name__}")
    bad = None
    if not name:
        bad = "is empty"
    elif len(name) > max_len:
        bad = f"is {len(name)} characters long (at most {max_len})"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        bad = "holds a control character"
    elif any(c in _GLOB for c in name):
        bad = "holds a glob character (* ? [ ])"
    elif any(c in _BRACES for c in name):
        bad = "holds a brace ({ }), which would change the Redis hash tag"
    elif any(c in _SEPARATORS for c in name):
        bad = "holds a path separator (/ or \\)"
    elif ".." in name:
        bad = "holds '..'"
    elif name != name.strip():
        bad = "starts or ends with white space"
    if bad:
        shown = name if len(name) <= 40 else name[:40] + "..."
        raise BadName(f"{kind} {shown!r} {bad}; use letters, digits, '-', '_', '.' or ':'")
    return name


def check_path(kind: str, path, max_len: int = 4096) -> str:
    """A path given on the command line or in config: a string without control or glob characters."""
    if not isinstance(path, str):
        path = str(path)
    if len(path) > max_len:
        raise BadName(f"{kind} is {len(path)} characters long (at most {max_len})")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise BadName(f"{kind} {path[:60]!r} holds a control character")
    if any(c in _GLOB for c in path):
        raise BadName(f"{kind} {path[:60]!r} holds a glob character (* ? [ ]); give the path itself")
    return path


def _f(default, doc: str):
    return field(default=default, metadata={"doc": doc})


def _f_dict(doc: str):
    return field(default_factory=dict, metadata={"doc": doc})


@dataclass(frozen=True)
class JobConfig:
    name: str = _f("quickstart", "job name; every Redis key of the job carries it")
    seed: int = _f(0, "seed of the feeder's prompt order, sampling and the learner")
    steps: int = _f(30, "policy updates (learner steps) to run")
    train_prompts: str = _f("examples/data/calc_train.jsonl", "JSONL prompt file the feeder cycles through")
    eval_prompts: str = _f("examples/data/calc_eval.jsonl", "JSONL held-out prompts for greedy evaluation")
    eval_size: int = _f(200, "held-out prompts evaluated at the start, the end and every eval_every learner steps")
    eval_every: int = _f(10, "learner steps between held-out evaluations during the run, one per interval across the rollout workers (0: start and end only)")


@dataclass(frozen=True)
class PolicyConfig:
    path: str = _f("", "a Hugging Face causal LM directory to train (weights, config, tokenizer); "
                   "empty: build and warm-start the tiny built-in policy")
    cache_dir: str = _f(".cache/policies", "where built and warm-started policies are cached, keyed by this section "
                        "(the warm start's calibrated settings are workers.tiny_policy.DEFAULT_SPEC)")
    seed: int = _f(0, "seed of the initial weights and of the warm start")
    hidden_size: int = _f(128, "model width: a multiple of 64 (attention heads of 32)")
    num_layers: int = _f(2, "transformer layers")


@dataclass(frozen=True)
class RolloutConfig:
    workers: int = _f(1, "rollout worker processes (each holds one engine)")
    engine: str = _f("vllm", "generation engine: vllm")
    group_size: int = _f(8, "samples per prompt (one GRPO group)")
    groups_per_call: int = _f(8, "groups decoded together in one engine call; reloads happen between calls")
    temperature: float = _f(1.0, "sampling temperature, in (0, 2]; behaviour log-probs are those of the "
                            "temperature-scaled distribution, and the learner scales its logits by the same 1/T")
    max_turns: int = _f(4, "model turns per episode (each tool call ends a turn)")
    max_tokens_per_turn: int = _f(48, "tokens generated per turn at most")
    tool_timeout_s: float = _f(2.0, "the longest one tool call (environment step) may take; its thread is then "
                               "abandoned (past 64 hung calls the worker exits and its agent restarts it)")
    on_tool_timeout: str = _f("dead_letter", "a tool call past tool_timeout_s: dead_letter (the episode ends and its "
                              "group is dead-lettered with the error) or reply (the environment's timeout_reply is "
                              "inserted and the episode goes on: for tools whose slowness is the policy's doing)")
    tool_retries: int = _f(2, "retries of a tool call (environment step) that raises, within tool_timeout_s; "
                           "then the group is dead-lettered with the error")
    gpu_memory_utilization: float = _f(0.02, "share of device memory (host RAM on CPU) the engine reserves")
    max_model_len: int = _f(256, "longest prompt + completion the engine accepts (at most the policy's max_position_embeddings)")
    dtype: str = _f("float32", "the engine's weights and activations: float32, bfloat16, float16 or auto "
                    "(vLLM's pick: the platform's preferred 16-bit type, as the learner publishes float32); "
                    "a dtype other than the learner's widens the behaviour/learner log-prob gap")
    kv_cache_bytes: int = _f(1 << 30, "KV cache size per engine in bytes; 0: vLLM sizes it from "
                             "gpu_memory_utilization (on a GPU, after profiling the model)")
    enforce_eager: bool = _f(True, "run the model eagerly; false lets vLLM compile it and capture CUDA graphs "
                             "(minutes at start, faster decoding on a GPU)")
    tensor_parallel_size: int = _f(1, "GPUs each engine shards the model over")


@dataclass(frozen=True)
class EnvConfig:
    entry: str = _f("calc", "the environment: \"package.module:ClassName\", or a name registered in the "
                    "libra.envs entry points (calc, guess)")
    options: dict = _f_dict("keyword arguments of the environment's class, e.g. {tool_delay_s = 0.5}")
    chat_template: str = _f("auto", "render prompts and replies through the policy's chat template: "
                            "auto (when it has one), on or off")


@dataclass(frozen=True)
class RewardConfig:
    workers: int = _f(1, "reward worker processes")
    verifier_retries: int = _f(2, "retries of a failing verifier before the group is dead-lettered")
    timeout_s: float = _f(30.0, "the longest one reward call may take; a call past it is abandoned and counts "
                          "as a failed try (retried, then the group is dead-lettered)")
    entry: str = _f("", "\"package.module:function\" (task, transcript) -> float scoring each episode; "
                    "empty: the environment's reward")
    model: str = _f("", "a Hugging Face sequence-classification directory (one label) that scores prompt + "
                    "transcript; reward workers load it on their slot's GPU, else the CPU")


@dataclass(frozen=True)
class LearnerConfig:
    workers: int = _f(1, "learner slots at the start; the learner runs one data-parallel rank per slot it holds "
                      "(world size = slots held, one GPU each), and afterwards the controller's placement decides "
                      "its slots (all on one node, between control.min_learner and control.max_learner); "
                      "a change of world size happens at a drain, after a checkpoint")
    batch_size: int = _f(256, "trajectories per policy update; a multiple of rollout.group_size")
    lr: float = _f(5e-4, "AdamW learning rate after warmup")
    warmup_steps: int = _f(3, "steps of linear learning-rate warmup")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    clip_eps: float = _f(0.2, "PPO clip range of the importance ratio")
    max_grad_norm: float = _f(1.0, "gradient norm clip")
    max_staleness: int = _f(2, "groups generated more than this many learner updates ago (along the version tree, so a "
                                    "restore adds none) are dropped; 0 is synchronous (on-policy): the feeder issues one "
                                    "batch per version and rollout generates it with that version's weights")
    publish_every: int = _f(1, "steps between weight publications (at most max_staleness; 1 when it is 0); the "
                                "controller may stretch it up to control.publish_every_max while staleness has room")
    objective: str = _f("decoupled", "the policy loss: decoupled (PPO clipped against the proximal policy, the "
                        "learner's weights before the update, times the behaviour importance weight truncated at "
                        "is_cap) or behaviour (PPO clipped against the behaviour policy's log-probs, one "
                        "optimizer step per batch, kept for comparison)")
    mini_batches: int = _f(1, "optimizer steps per batch (decoupled only): the batch is cut into this many "
                           "mini-batches of whole groups, each clipped against the same proximal policy")
    is_cap: float = _f(2.0, "decoupled: the behaviour importance weight pi_prox / pi_behaviour is truncated "
                       "at this value")
    is_mask: float = _f(0.0, "decoupled: tokens whose behaviour importance weight is above this or below its "
                        "inverse are masked out of the loss (0: no masking)")
    trust_clip: float = _f(0.2, "decoupled: a token whose behaviour importance weight shows it already moved more "
                           "than this since it was sampled, in its advantage's direction, gets no gradient (PPO's "
                           "trust region against the behaviour policy; 0: off)")
    dual_clip: float = _f(3.0, "for a negative advantage the clipped term is bounded below by dual_clip x "
                          "advantage (dual-clip PPO), so a large ratio cannot weigh without limit (0: off)")
    advantage: str = _f("grpo", "grpo: (r - mean) / std within each group, loss averaged over the batch's policy "
                        "tokens; dr_grpo: r - mean (no std division), loss divided by a constant (batch "
                        "trajectories x rollout.max_turns x rollout.max_tokens_per_turn)")
    dynamic_sampling: bool = _f(False, "groups whose rewards are all equal (no signal) do not count towards "
                                "batch_size: the learner reads on until the batch holds batch_size trajectories "
                                "of groups with signal (the others are consumed and counted as filtered)")
    dynamic_sampling_max: float = _f(4.0, "dynamic sampling reads at most this many batch_size's worth of "
                                     "trajectories for one step, then trains what it has")
    prefetch: bool = _f(True, "train each admitted group as it arrives (its gradient accumulated, a micro-batch "
                        "at a time) and step the optimizer once the batch is whole, so the learner does not "
                        "wait idle for a batch's last groups; one rank and one mini-batch only (the same "
                        "update, to float rounding)")
    last_chance_first: bool = _f(True, "read scored groups ahead of the batch (up to 1 + streams.backlog_batches "
                                 "batches) and admit first the groups this step is the last to take (max_staleness "
                                 "updates old), then the rest in arrival order: a slow group that finished behind "
                                 "fresher ones is trained instead of dropped as stale at the next step (not with "
                                 "dynamic_sampling, whose steps may end at their cap)")
    checkpoint_every: int = _f(10, "steps between checkpoints (model, optimizer, consumed ids)")
    keep_published: int = _f(4, "published weight versions kept on disk")
    threads: int = _f(1, "torch CPU threads of the learner")
    step_budget_s: float = _f(60.0, "the longest a learner step (waiting for data included) is expected to take: "
                              "with checkpoint_write_s it sizes streams.learner_min_idle_s (checked at load); "
                              "a longer step is not stopped")
    checkpoint_write_s: float = _f(30.0, "the longest a checkpoint write is expected to take (see step_budget_s)")
    max_train_attempts: int = _f(3, "a scored group whose training raised this many times (counted across "
                                 "restarts), or killed the learner process this many times when tried alone, is "
                                 "dead-lettered with the error; the rest of its batch is trained")
    dtype: str = _f("fp32", "forward-pass precision: fp32, or bf16 (torch.autocast; master weights, optimizer "
                    "and log-softmax stay float32)")
    micro_batch_tokens: int = _f(8192, "padded tokens (rows x longest row) per forward/backward; bounds "
                                 "activation memory (8192: ~64 quick-start trajectories of ~120 tokens); "
                                 "a longer trajectory goes alone")
    logprob_chunk: int = _f(1024, "completion positions whose logits (x vocab) are computed at once; bounds "
                            "the LM head's memory")
    gradient_checkpointing: bool = _f(False, "recompute each layer's activations in the backward pass "
                                      "(less memory, ~30% more compute)")


@dataclass(frozen=True)
class StreamsConfig:
    max_queue_size: int = _f(256, "trajectories waiting downstream before the feeder and rollout pause")
    max_message_bytes: int = _f(8 << 20, "larger messages are dead-lettered")
    backlog_batches: float = _f(1.25, "the feeder holds new prompts while this many learner batches of generated "
                                "trajectories wait for the learner: rollout does not run ahead of a slower learner "
                                "into work that goes stale (0: no such hold)")
    block_ms: int = _f(500, "how long a consumer blocks on an empty stream (at most 10000: the socket timeout is 15 s)")
    rollout_min_idle_s: float = _f(300.0, "a prompt pending this long is reclaimed by another rollout worker; "
                                   "must exceed the slowest engine call")
    reward_min_idle_s: float = _f(60.0, "a group pending this long is reclaimed by another reward worker")
    learner_min_idle_s: float = _f(1800.0, "a scored group pending at the learner this long is stuck (libra-ctl "
                                   "audit names it; the learner, the stream's one consumer, replays its own "
                                   "pending entries after a restart); must exceed checkpoint_every x "
                                   "learner.step_budget_s + learner.checkpoint_write_s")
    max_deliveries: int = _f(3, "an entry delivered more often than this is dead-lettered")
    dedup: bool = _f(True, "exactly-once effects keyed by trajectory id (turn off only to test the audit)")


@dataclass(frozen=True)
class RedisConfig:
    url: str = _f("", "redis://, rediss:// or unix:// URL; empty: $LIBRA_REDIS_URL, else an embedded server")
    maxmemory: str = _f("2gb", "memory limit of the embedded server (noeviction: writes wait when full)")
    appendfsync: str = _f("everysec", "AOF fsync of the embedded server: everysec loses up to 1 s, always none")
    outage_s: float = _f(60.0, "how long every process waits for an unreachable Redis (backing off) before it fails")


@dataclass(frozen=True)
class MetricsConfig:
    interval_s: float = _f(10.0, "seconds between metric samples (metrics.jsonl and Redis)")
    diversity_every: int = _f(5, "learner steps between diversity measurements (0: never)")


@dataclass(frozen=True)
class ControlConfig:
    mode: str = _f("auto", "initial allocation mode: auto (the allocator moves slots) or pinned (the configured counts)")
    interval_s: float = _f(10.0, "the controller's reconcile period")
    window_s: float = _f(60.0, "metrics window the allocator sees")
    cooldown_s: float = _f(150.0, "no move sooner than this after the previous one (against flapping)")
    horizon_s: float = _f(900.0, "a move must pay for its transition cost within this time")
    switch_cost_s: float = _f(40.0, "seconds a slot yields nothing while it changes role")
    learner_scaling_exponent: float = _f(0.9, "n learner slots train at n**e times one")
    reward_on_slots: bool = _f(False, "reward workers hold slots (else they run on CPUs beside the slots)")
    min_rollout: int = _f(1, "fewest rollout workers")
    max_rollout: int = _f(1 << 30, "most rollout workers")
    min_learner: int = _f(1, "fewest learner slots")
    max_learner: int = _f(1 << 30, "most learner slots (the learner runs one data-parallel rank per slot)")
    min_reward: int = _f(1, "fewest reward workers")
    max_reward: int = _f(1 << 30, "most reward workers")
    min_slots: int = _f(0, "slots the job is guaranteed beside other jobs on the pool (raised to the smallest split "
                        "it runs on); a job whose minimum the pool cannot hold is refused")
    max_slots: int = _f(0, "most slots the job may hold (0: the whole pool)")
    priority: float = _f(1.0, "weight of the job's throughput gains (relative to its demand) against other jobs' "
                         "when spare slots are handed out or moved between jobs")
    publish_every_max: int = _f(4, "the controller may stretch the learner's publish cadence up to this many steps per "
                                "version (at most learner.max_staleness) while staleness has room: fewer weight loads; "
                                "1 keeps learner.publish_every")
    stale_drop_budget: float = _f(0.005, "share of trajectories the longer publish cadence may have dropped as stale; "
                                  "above it the cadence comes back a step")
    metrics_port: int = _f(9464, "the controller serves Prometheus /metrics here (0: off)")
    metrics_host: str = _f("127.0.0.1", "address /metrics binds (0.0.0.0: every interface, for a remote Prometheus)")


@dataclass(frozen=True)
class RunConfig:
    runs_dir: str = _f("runs", "where run directories are created")
    progress_s: float = _f(1.0, "seconds between progress line updates")
    slots: int = _f(0, "CPU slots the run's own node agent offers when it finds no GPU "
                    "(0: the slots its workers hold at the start: rollout.workers x "
                    "rollout.tensor_parallel_size + learner.workers, + reward.workers with "
                    "control.reward_on_slots)")


@dataclass(frozen=True)
class TrackingConfig:
    tensorboard: bool = _f(True, "write the run's metrics as TensorBoard event files under runs/<id>/tensorboard")
    wandb: str = _f("auto", "W&B: auto (when wandb is installed: offline unless $WANDB_MODE says otherwise), "
                    "offline, online or off; the run directory stays the source of truth")
    run_name: str = _f("", "the run's name in W&B and in TensorBoard's text tab; empty: <job.name>-seed<job.seed>")
    group: str = _f("", "the W&B group of the run (libra-ctl baseline and experiment set it to their own id)")


@dataclass(frozen=True)
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    run: RunConfig = field(default_factory=RunConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def slots_at_start(self) -> int:
        """Slots (GPUs) the run's workers hold at the start: rollout x its tensor parallel size, the learner's,
        and reward's with ``control.reward_on_slots``."""
        return (self.rollout.workers * self.rollout.tensor_parallel_size + self.learner.workers
                + (self.reward.workers if self.control.reward_on_slots else 0))


# --- loading ------------------------------------------------------------------------------


def load(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Load a TOML file (or the defaults when ``path`` is None) and apply ``key=value`` overrides."""
    raw: dict = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); TOML files are UTF-8") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        _apply_override(raw, item)
    cfg = from_dict(raw)
    validate(cfg)
    return cfg


def _apply_override(raw: dict, item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. --set learner.lr=1e-4")
    *parents, leaf = key.strip().split(".")
    try:
        value = tomllib.loads(f"x = {text}")["x"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word is a string: --set job.name=demo
    if _field_type(parents, leaf) is str and not isinstance(value, str):
        value = text.strip()   # a word of a string setting that TOML reads otherwise: job.name=42, a date
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {p!r} is not a section")
    if isinstance(value, dict) and dataclasses.is_dataclass(_field_type(parents, leaf)):
        # a section given as a table (--set 'learner={lr=1e-4}'): its keys are set, the file's others stay
        if not isinstance(node.get(leaf, {}), dict):
            raise ConfigError(f"--set {key}: {leaf!r} is not a section")
        _merge(node.setdefault(leaf, {}), value)
        return
    node[leaf] = value


def _merge(into: dict, table: dict) -> None:
    for k, v in table.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _field_type(parents: list[str], leaf: str):
    """The type of the setting ``parents.leaf`` (None where there is no such setting)."""
    cls = Config
    for p in parents:
        typ = get_type_hints(cls).get(p) if dataclasses.is_dataclass(cls) else None
        if not dataclasses.is_dataclass(typ):
            return None
        cls = typ
    return get_type_hints(cls).get(leaf)


def from_dict(raw: dict, cls=Config, where: str = "") -> Any:
    """Build the dataclass tree from plain data, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"unknown key {where + key!r}; known keys here: {', '.join(sorted(known))}")
    kwargs = {}
    for f in fields(cls):
        if f.name not in raw:
            continue
        typ, value, dotted = hints[f.name], raw[f.name], where + f.name
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = from_dict(value, typ, dotted + ".")
        else:
            kwargs[f.name] = _coerce(value, typ, dotted, default_of(f))
    return cls(**kwargs)


def _coerce(value, typ, dotted: str, default):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is dict and isinstance(value, dict):
        try:   # the manifest carries it to every worker as JSON
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{dotted} = {value!r}: {exc}; give strings, numbers, booleans, arrays and "
                              "tables (a date as a quoted string)") from None
    if isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{dotted} = {value!r}: expected {typ.__name__} (default {default!r}); "
        f"fix it in the file or with --set {dotted}=<{typ.__name__}>")


def _is_entry(text: str) -> bool:
    module, sep, attr = text.partition(":")
    return bool(sep and module and attr and all(part.isidentifier() for part in module.split("."))
                and attr.isidentifier())


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


MAX_INT = (1 << 63) - 1   # Redis integers are 64-bit
MAX_SEED = (1 << 32) - 1  # numpy's legacy seed, which the engine seeds from job.seed, is 32-bit
_MEMORY = re.compile(r"[0-9]+(b|k|kb|m|mb|g|gb)?", re.IGNORECASE)   # Redis's memory sizes: 100mb, 2gb, 1048576
MAX_TEXT = 4096           # the longest string setting (a path, a URL)
TOOL_TIMEOUT_ACTIONS = ("dead_letter", "reply")   # rollout.on_tool_timeout
_ENTRY_POINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def validate_values(cfg: Config) -> None:
    """Every number finite, not negative and within 64 bits; every string free of control characters.

    No setting of Libra means anything below 0, and a NaN or an infinity
    passes every ``<``/``>`` check while breaking what it sizes (a timeout,
    a learning rate), so both are refused here for every field at once.
    """
    for sec in fields(cfg):
        section = getattr(cfg, sec.name)
        for f in fields(section):
            value, key = getattr(section, f.name), f"{sec.name}.{f.name}"
            if isinstance(value, float):
                _need(math.isfinite(value), key, f"{value} is not a finite number; give a number such as "
                      f"{default_of(f)!r}")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                _need(value >= 0, key, f"{value} is negative; use a value >= 0")
                _need(value <= MAX_INT, key, f"{value} is too large (at most {MAX_INT})")
            if isinstance(value, str):
                _need(len(value) <= MAX_TEXT, key, f"{len(value)} characters long; at most {MAX_TEXT}")
                _need(not any(ord(c) < 32 or ord(c) == 127 for c in value), key,
                      f"{value[:60]!r} holds a control character")


def validate(cfg: Config) -> None:
    """Cross-field checks; each message says the fix."""
    need = _need
    lr, ro = cfg.learner, cfg.rollout
    validate_values(cfg)
    try:
        check_name("job.name", cfg.job.name)
    except BadName as exc:
        raise ConfigError(str(exc)) from None
    need(cfg.job.steps >= 1, "job.steps", "run at least 1 step")
    need(cfg.job.seed <= MAX_SEED, "job.seed", f"{cfg.job.seed} is too large: the engine's seed is 32-bit (at most "
         f"{MAX_SEED})")
    need(cfg.policy.seed <= MAX_SEED, "policy.seed", f"{cfg.policy.seed} is too large (at most {MAX_SEED})")
    need(cfg.job.eval_size >= 1, "job.eval_size", "evaluate at least 1 held-out prompt (the run's start, end and "
         "curve are judged on them)")
    need(cfg.rollout.max_model_len >= 2, "rollout.max_model_len",
         f"{cfg.rollout.max_model_len}: a prompt and a completion need at least 2 tokens; e.g. 256")
    need(ro.group_size >= 2, "rollout.group_size", "GRPO needs at least 2 samples per prompt")
    need(lr.batch_size >= ro.group_size and lr.batch_size % ro.group_size == 0, "learner.batch_size",
         f"{lr.batch_size} is not a positive multiple of rollout.group_size ({ro.group_size}); "
         f"try {max(1, round(lr.batch_size / ro.group_size)) * ro.group_size}")
    need(lr.max_staleness >= 0, "learner.max_staleness", "must be >= 0 (0: synchronous, on-policy)")
    need(1 <= lr.publish_every <= max(1, lr.max_staleness), "learner.publish_every",
         f"{lr.publish_every} must be between 1 and max(1, learner.max_staleness) ({max(1, lr.max_staleness)})")
    need(lr.objective in ("decoupled", "behaviour"), "learner.objective",
         f"{lr.objective!r}: use decoupled or behaviour")
    need(lr.mini_batches >= 1, "learner.mini_batches", "must be >= 1")
    need(lr.mini_batches == 1 or lr.objective == "decoupled", "learner.mini_batches",
         "several optimizer steps per batch need learner.objective = \"decoupled\" (the clip must be anchored "
         "at the weights before the update)")
    need(lr.mini_batches <= lr.batch_size // ro.group_size, "learner.mini_batches",
         f"{lr.mini_batches} is more than the batch's groups ({lr.batch_size // ro.group_size})")
    need(lr.is_cap >= 1.0, "learner.is_cap", f"{lr.is_cap:g}: the truncation must be >= 1, e.g. 2")
    need(lr.is_mask == 0.0 or lr.is_mask > 1.0, "learner.is_mask", f"{lr.is_mask:g}: use 0 (off) or a bound > 1, e.g. 5")
    need(0.0 <= lr.trust_clip < 1.0, "learner.trust_clip", f"{lr.trust_clip:g}: use 0 (off) or a share below 1, e.g. 0.2")
    need(lr.dual_clip == 0.0 or lr.dual_clip > 1.0, "learner.dual_clip", f"{lr.dual_clip:g}: use 0 (off) or > 1, e.g. 3")
    need(lr.advantage in ("grpo", "dr_grpo"), "learner.advantage", f"{lr.advantage!r}: use grpo or dr_grpo")
    need(lr.dynamic_sampling_max >= 1.0, "learner.dynamic_sampling_max", "must be >= 1 (batches' worth read per step)")
    need(lr.checkpoint_every >= 1, "learner.checkpoint_every", "must be >= 1")
    need(lr.max_train_attempts >= 1, "learner.max_train_attempts", "must be >= 1")
    need(lr.workers >= 1, "learner.workers", "the learner needs at least 1 slot; set 1 or more")
    need(lr.keep_published >= 2, "learner.keep_published", "keep at least 2 versions so a loading worker never loses its files")
    need(ro.engine == "vllm", "rollout.engine", f"unknown engine {ro.engine!r}; use \"vllm\"")
    need(0 < ro.temperature <= 2.0, "rollout.temperature",
         f"{ro.temperature:g} is outside (0, 2]; greedy decoding is for evaluation only, sample with e.g. 1.0")
    need(ro.dtype in ("float32", "bfloat16", "float16", "auto"), "rollout.dtype",
         f"{ro.dtype!r}: use float32, bfloat16, float16 or auto")
    need(ro.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1 (1: one GPU per engine)")
    need(lr.dtype in ("fp32", "bf16"), "learner.dtype", f"{lr.dtype!r}: use fp32 or bf16")
    need(lr.micro_batch_tokens >= 1, "learner.micro_batch_tokens", "must be >= 1, e.g. 8192")
    need(lr.logprob_chunk >= 1, "learner.logprob_chunk", "must be >= 1, e.g. 1024")
    need(ro.workers >= 1 and cfg.reward.workers >= 1, "rollout.workers/reward.workers", "each stage needs >= 1 worker")
    need(ro.max_turns >= 1 and ro.max_tokens_per_turn >= 1, "rollout.max_turns", "must be >= 1")
    need(ro.groups_per_call >= 1, "rollout.groups_per_call", "must be >= 1 (groups read and decoded per call)")
    need(lr.threads >= 1, "learner.threads", "must be >= 1 (torch CPU threads)")
    need(cfg.policy.hidden_size >= 64 and cfg.policy.hidden_size % 64 == 0, "policy.hidden_size",
         f"{cfg.policy.hidden_size}: the tiny policy's width is a multiple of 64 (attention heads of 32), e.g. 128")
    need(cfg.policy.num_layers >= 1, "policy.num_layers", "must be >= 1")
    need(0 < ro.gpu_memory_utilization <= 0.95, "rollout.gpu_memory_utilization", "must be in (0, 0.95]")
    need(cfg.streams.max_queue_size >= lr.batch_size, "streams.max_queue_size",
         f"{cfg.streams.max_queue_size} is below learner.batch_size ({lr.batch_size}); the learner could never fill a batch")
    st = cfg.streams
    hold_s = lr.checkpoint_every * lr.step_budget_s + lr.checkpoint_write_s
    need(st.learner_min_idle_s > hold_s, "streams.learner_min_idle_s",
         f"{st.learner_min_idle_s:g}s does not exceed the time the learner holds a step's entries before its "
         f"checkpoint acknowledges them (checkpoint_every {lr.checkpoint_every} x step_budget_s "
         f"{lr.step_budget_s:g} + checkpoint_write_s {lr.checkpoint_write_s:g} = {hold_s:g}s); raise it above "
         f"{hold_s:g} or checkpoint more often")
    validate_control(cfg.control)
    start = {"rollout": ro.workers, "learner": lr.workers, "reward": cfg.reward.workers}
    for role, n in start.items():
        if role == "reward" and not cfg.control.reward_on_slots:
            continue   # reward on CPUs: the controller does not size it
        lo, hi = getattr(cfg.control, f"min_{role}"), getattr(cfg.control, f"max_{role}")
        need(lo <= n <= hi, f"{role}.workers", f"{n} is outside control.min_{role}..control.max_{role} "
             f"({lo}..{hi}): the run would start where the controller may not keep it")
    need(cfg.env.chat_template in ("auto", "on", "off"), "env.chat_template",
         f"{cfg.env.chat_template!r}: use auto, on or off")
    need(_is_entry(cfg.env.entry) or bool(_ENTRY_POINT_NAME.fullmatch(cfg.env.entry)), "env.entry",
         f"{cfg.env.entry!r}: name an environment, e.g. \"calc\" or \"mypkg.envs:MyEnv\"")
    need(not cfg.reward.entry or _is_entry(cfg.reward.entry), "reward.entry",
         f"{cfg.reward.entry!r}: write \"package.module:function\"")
    need(not (cfg.reward.entry and cfg.reward.model), "reward.model", "set reward.entry or reward.model, not both")
    need(cfg.metrics.interval_s > 0, "metrics.interval_s", "must be > 0")
    need(ro.tool_timeout_s > 0, "rollout.tool_timeout_s", "must be > 0, e.g. 2.0")
    need(ro.on_tool_timeout in TOOL_TIMEOUT_ACTIONS, "rollout.on_tool_timeout",
         f"{ro.on_tool_timeout!r}: one of {', '.join(TOOL_TIMEOUT_ACTIONS)}")
    need(cfg.reward.timeout_s > 0, "reward.timeout_s", "must be > 0, e.g. 30.0")
    need(lr.step_budget_s > 0, "learner.step_budget_s", "must be > 0, e.g. 60.0")
    need(cfg.streams.backlog_batches >= 0, "streams.backlog_batches", "must be >= 0 (0: the feeder never holds "
         "for the learner's backlog)")
    need(cfg.streams.block_ms >= 1, "streams.block_ms", "must be >= 1 (0 would block a consumer forever)")
    need(cfg.streams.max_message_bytes >= 1, "streams.max_message_bytes", "must be >= 1, e.g. 8388608")
    need(cfg.run.progress_s > 0, "run.progress_s", "must be > 0")
    need(cfg.control.metrics_port <= 65535, "control.metrics_port", "a TCP port: 0 (off) to 65535")
    need(st.max_deliveries >= 1, "streams.max_deliveries", "must be >= 1")
    need(min(st.rollout_min_idle_s, st.reward_min_idle_s) > 0, "streams.*_min_idle_s", "must be > 0")
    need(cfg.redis.appendfsync in ("always", "everysec", "no"), "redis.appendfsync", "use always, everysec or no")
    need(cfg.tracking.wandb in ("auto", "offline", "online", "off"), "tracking.wandb",
         f"{cfg.tracking.wandb!r}: use auto, offline, online or off")
    need(cfg.redis.outage_s > 0, "redis.outage_s", "must be > 0, e.g. 60")
    need(bool(_MEMORY.fullmatch(cfg.redis.maxmemory)), "redis.maxmemory",
         f"{cfg.redis.maxmemory!r}: a size as Redis writes it, e.g. 2gb, 512mb or 1073741824")
    need(0 <= st.block_ms <= 10_000, "streams.block_ms",
         f"{st.block_ms}: use 0..10000 (a longer block would outlast the client's socket timeout)")
    url = cfg.redis.url
    need(not url or url.startswith(("redis://", "rediss://", "unix://")), "redis.url",
         f"{url!r} is not a redis://, rediss:// or unix:// URL")


def validate_control(ctl: ControlConfig) -> None:
    """The ``[control]`` checks, also run on a manifest's settings when the controller loads a job."""
    need = _need
    need(ctl.mode in ("auto", "pinned"), "control.mode", f"{ctl.mode!r}: use auto or pinned")
    need(ctl.interval_s > 0, "control.interval_s", "must be > 0")
    need(ctl.window_s > 0, "control.window_s", "must be > 0")
    for role in ("rollout", "learner", "reward"):
        need(getattr(ctl, f"min_{role}") >= 1, f"control.min_{role}", "must be >= 1: every stage needs a worker")
        need(getattr(ctl, f"min_{role}") <= getattr(ctl, f"max_{role}"), f"control.min_{role}",
             f"exceeds control.max_{role}")
    need(0 < ctl.learner_scaling_exponent <= 1.5, "control.learner_scaling_exponent",
         "must be in (0, 1.5]: n learner slots train at n**e times one (1: linear); a learner that must not "
         "grow is control.max_learner = 1")
    need(ctl.min_slots >= 0, "control.min_slots", "must be >= 0")
    need(ctl.max_slots >= 0, "control.max_slots", "must be >= 0 (0: the whole pool)")
    need(not ctl.max_slots or ctl.min_slots <= ctl.max_slots, "control.min_slots", "exceeds control.max_slots")
    least = ctl.min_rollout + ctl.min_learner + (ctl.min_reward if ctl.reward_on_slots else 0)
    need(not ctl.max_slots or least <= ctl.max_slots, "control.max_slots",
         f"{ctl.max_slots} is below the roles' minimums ({least}: control.min_rollout + min_learner"
         f"{' + min_reward' if ctl.reward_on_slots else ''}); the job could never start")
    need(ctl.priority > 0, "control.priority", "must be > 0")
    need(ctl.publish_every_max >= 1, "control.publish_every_max", "must be >= 1 (1: the cadence stays fixed)")
    need(0 <= ctl.stale_drop_budget < 1, "control.stale_drop_budget", "must be in [0, 1)")


def _section_name(cfg: Config, section) -> str:
    return next(f.name for f in fields(cfg) if getattr(cfg, f.name) is section)


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def reference() -> str:
    """The config reference as Markdown (used by the README)."""
    lines = []
    for sec in fields(Config):
        lines.append(f"\n[{sec.name}]\n")
        for f in fields(sec.default_factory):
            lines.append(f"- `{f.name}` = `{default_of(f)!r}`: {f.metadata['doc']}")
    return "\n".join(lines)
