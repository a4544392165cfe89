"""Wire messages between the stages: typed, tagged with a kind, versioned, msgpack.

Every stream entry has one field, ``m``, holding a msgpack map with ``v`` (the
schema version) and ``kind``. Token arrays travel as raw little-endian bytes
whose dtype the schema fixes (int32 tokens, uint8 masks, float32 log-probs),
never as lists. Decoding validates everything and raises ``BadMessage`` with a
specific reason, which the stage loop dead-letters; nothing is ever unpickled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
MAX_JSON_DEPTH = 16   # an answer nested deeper is refused (a bound on what a decoder recurses into)
FIELD = b"m"  # the one field of every stream entry

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
LOGPROB_DTYPE = np.dtype("<f4")


class BadMessage(ValueError):
    """A message that cannot be decoded or validated; ``reason`` goes to the dead-letter stream."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Prompt:
    """feeder -> rollout: one prompt, to become one GRPO group."""

    prompt_id: str
    prompt: str
    answer: Any  # ground truth for the reward (any JSON value); the policy never sees it
    issued_at: float
    # the policy version published when it was issued: rollout generates it with these weights or newer
    # (what makes learner.max_staleness = 0 on-policy: no group made by weights older than its batch's)
    min_version: int = 0


@dataclass(frozen=True)
class Trajectory:
    """One sample of a group. Its id is (prompt_id, sample_idx): a regenerated sample keeps it."""

    sample_idx: int
    completion: np.ndarray  # int32 [n]: generated and tool tokens interleaved
    mask: np.ndarray  # uint8 [n]: 1 = sampled from the policy, 0 = inserted by the tool
    logprobs: np.ndarray  # float32 [n]: behaviour log-prob per token, 0 where mask is 0
    text: str
    finish: str
    turns: int
    tool_calls: int
    tool_latency_s: tuple[float, ...]
    tool_timeouts: int
    reward: float | None = None  # set by the reward stage


@dataclass(frozen=True)
class Group:
    """rollout -> reward (rewards unset) and reward -> learner (rewards set): a whole GRPO group."""

    prompt_id: str
    prompt: str
    answer: Any  # as in Prompt
    prompt_tokens: np.ndarray  # int32 [p]
    version: int  # policy version that generated every sample (the oldest, were there two)
    worker: str
    generated_at: float
    gen_s: float
    trajectories: tuple[Trajectory, ...]
    scored_at: float | None = None
    extra: dict = field(default_factory=dict)  # free-form timings; small scalars only

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def trajectory_ids(self) -> list[str]:
        """Its samples' ids, (prompt_id, sample_idx) written prompt_id/sample_idx: the learner's checkpoints
        record them so, and the audit reads them so."""
        return [f"{self.prompt_id}/{t.sample_idx}" for t in self.trajectories]

    def with_rewards(self, rewards: list[float], scored_at: float) -> "Group":
        # Built field by field rather than with dataclasses.replace, which introspects the class
        # on every call: the reward stage does this for every trajectory it passes on.
        trajs = tuple(Trajectory(sample_idx=t.sample_idx, completion=t.completion, mask=t.mask,
                                 logprobs=t.logprobs, text=t.text, finish=t.finish, turns=t.turns,
                                 tool_calls=t.tool_calls, tool_latency_s=t.tool_latency_s,
                                 tool_timeouts=t.tool_timeouts, reward=float(r))
                      for t, r in zip(self.trajectories, rewards, strict=True))
        return replace(self, trajectories=trajs, scored_at=scored_at)


# --- encoding -----------------------------------------------------------------------------


def encode(msg: Prompt | Group) -> bytes:
    if isinstance(msg, Prompt):
        body = {"kind": "prompt", "prompt_id": msg.prompt_id, "prompt": msg.prompt,
                "answer": msg.answer, "issued_at": msg.issued_at, "min_version": msg.min_version}
    else:
        body = {
            "kind": "group", "prompt_id": msg.prompt_id, "prompt": msg.prompt,
            "answer": msg.answer, "prompt_tokens": _bytes(msg.prompt_tokens, TOKEN_DTYPE),
            "version": msg.version, "worker": msg.worker, "generated_at": msg.generated_at,
            "gen_s": msg.gen_s, "scored_at": msg.scored_at, "extra": msg.extra,
            "trajectories": [_encode_traj(t) for t in msg.trajectories],
        }
    body["v"] = SCHEMA_VERSION
    return msgpack.packb(body, use_bin_type=True)


def _bytes(arr: np.ndarray, dtype: np.dtype):
    """The array's bytes for msgpack's bin type, copied only when they are not already laid out right.

    A decoded array is a view on the bytes it came in (``np.frombuffer``), so a
    stage that passes it on re-sends those bytes as they are; any other array
    of the right dtype and layout goes as a memoryview, which msgpack copies
    once into its buffer.
    """
    if type(arr) is np.ndarray and arr.dtype == dtype and arr.flags.c_contiguous:
        base = arr.base
        if type(base) is bytes and len(base) == arr.nbytes:
            return base
        return memoryview(arr).cast("B") if arr.size else b""
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


def _encode_traj(t: Trajectory) -> dict:
    return {
        "sample_idx": t.sample_idx, "completion": _bytes(t.completion, TOKEN_DTYPE),
        "mask": _bytes(t.mask, MASK_DTYPE), "logprobs": _bytes(t.logprobs, LOGPROB_DTYPE),
        "text": t.text, "finish": t.finish, "turns": t.turns, "tool_calls": t.tool_calls,
        "tool_latency_s": list(t.tool_latency_s), "tool_timeouts": t.tool_timeouts,
        "reward": t.reward,
    }


# --- decoding and validation ----------------------------------------------------------------


def decode(payload: bytes, max_bytes: int) -> Prompt | Group:
    """Decode one entry's payload; raises BadMessage naming what is wrong."""
    if len(payload) > max_bytes:
        raise BadMessage(f"oversized: {len(payload)} bytes > max_message_bytes {max_bytes}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise BadMessage(f"malformed msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise BadMessage(f"malformed message: a {type(body).__name__}, not a map")
    version = body.get("v")
    if version != SCHEMA_VERSION:
        raise BadMessage(f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    kind = body.get("kind")
    if kind == "prompt":
        prompt_id, prompt, issued_at = _fields(body, _PROMPT_FIELDS, _PROMPT_TYPES)
        _finite("issued_at", issued_at)
        min_version = body.get("min_version", 0)
        if type(min_version) is not int or min_version < 0:
            raise BadMessage(f"field 'min_version' must be an int >= 0, not {min_version!r}")
        return Prompt(prompt_id, prompt, _json_field(body, "answer"), issued_at, min_version)
    if kind == "group":
        return _decode_group(body)
    raise BadMessage(f"unknown message kind {kind!r}")


# Required fields of each map and their exact types. ``_fields`` checks them all in one pass of C
# loops; only when that fails does it go field by field, to coerce an int where a float goes and to
# name the first field that is missing or mistyped.
_PROMPT_FIELDS = ("prompt_id", "prompt", "issued_at")
_PROMPT_TYPES = (str, str, float)
_GROUP_FIELDS = ("prompt_id", "prompt", "prompt_tokens", "version", "worker", "generated_at", "gen_s",
                 "trajectories")
_GROUP_TYPES = (str, str, bytes, int, str, float, float, list)
_TRAJ_FIELDS = ("sample_idx", "completion", "mask", "logprobs", "text", "finish", "turns", "tool_calls",
                "tool_latency_s", "tool_timeouts")
_TRAJ_TYPES = (int, bytes, bytes, bytes, str, str, int, int, list, int)
_SCALARS = (int, float, str, bool, type(None))
_MISSING = object()


def _fields(body: dict, names: tuple[str, ...], types: tuple[type, ...]) -> tuple:
    values = tuple(map(body.get, names))
    if tuple(map(type, values)) == types:  # msgpack yields exact types, so bool never passes for int
        return values
    return tuple(_get(body, name, typ) for name, typ in zip(names, types))


def _get(body: dict, name: str, typ: type, optional: bool = False):
    value = body.get(name, _MISSING)
    if type(value) is typ:
        return value
    if value is _MISSING or (optional and value is None):
        if optional:
            return None
        raise BadMessage(f"missing field {name!r}")
    if typ is float and type(value) is int:
        return float(value)
    raise BadMessage(f"field {name!r}: expected {typ.__name__}, got {type(value).__name__}")


def _json_field(body: dict, name: str):
    """A required field that may hold any JSON value (an answer: a number, a string, a list, a map)."""
    if name not in body:
        raise BadMessage(f"missing field {name!r}")
    value = body[name]
    try:
        _check_json(value, 0)
    except ValueError as exc:
        raise BadMessage(f"field {name!r}: {exc}") from None
    return value


def _check_json(value, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH}")
    if type(value) in _SCALARS:
        return
    if type(value) is list:
        for v in value:
            _check_json(v, depth + 1)
    elif type(value) is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise ValueError(f"map key {k!r} is not a string")
            _check_json(v, depth + 1)
    else:
        raise ValueError(f"a {type(value).__name__} is not a JSON value")


def _array(name: str, raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise BadMessage(f"field {name!r}: {len(raw)} bytes is not a whole number of {dtype}")
    return np.frombuffer(raw, dtype=dtype)  # zero-copy, read-only view on the payload's bytes


def _decode_group(body: dict) -> Group:
    prompt_id, prompt, prompt_tokens, version, worker, generated_at, gen_s, raw_trajs = _fields(
        body, _GROUP_FIELDS, _GROUP_TYPES)
    answer = _json_field(body, "answer")
    _finite("generated_at", generated_at)
    _finite("gen_s", gen_s)
    if not raw_trajs:
        raise BadMessage("empty group: no trajectories")
    trajs = tuple(map(_decode_traj, raw_trajs))
    seen: set[int] = set()
    for t in trajs:    # a sample's id is (prompt_id, sample_idx): two with one id would be trained as one
        if t.sample_idx in seen:
            raise BadMessage(f"repeated sample_idx {t.sample_idx} in group {prompt_id!r}")
        seen.add(t.sample_idx)
    extra = _get(body, "extra", dict, optional=True) or {}
    for key, value in extra.items():
        if type(value) not in _SCALARS:
            raise BadMessage(f"field 'extra': {key!r} is a {type(value).__name__}, not a scalar")
    scored_at = _get(body, "scored_at", float, optional=True)
    if scored_at is not None:
        _finite("scored_at", scored_at)
    return Group(prompt_id=prompt_id, prompt=prompt, answer=answer,
                 prompt_tokens=_array("prompt_tokens", prompt_tokens, TOKEN_DTYPE), version=version,
                 worker=worker, generated_at=generated_at, gen_s=gen_s, trajectories=trajs,
                 scored_at=scored_at, extra=extra)


def _finite(name: str, value: float) -> None:
    """Times and durations are finite numbers: a NaN would pass every comparison and poison the metrics."""
    if not math.isfinite(value):
        raise BadMessage(f"field {name!r}: {value} is not a finite number")


def _decode_traj(body) -> Trajectory:
    if type(body) is not dict:
        raise BadMessage("malformed trajectory: not a map")
    idx, completion, mask, logprobs, text, finish, turns, tool_calls, latencies, timeouts = _fields(
        body, _TRAJ_FIELDS, _TRAJ_TYPES)
    if not completion:
        raise BadMessage(f"empty trajectory: sample {idx} has no tokens")
    completion = _array("completion", completion, TOKEN_DTYPE)
    if mask.translate(None, b"\x00\x01"):  # what is left once every 0 and 1 byte is deleted
        raise BadMessage(f"trajectory {idx}: mask holds a value other than 0 and 1")
    logprobs = _array("logprobs", logprobs, LOGPROB_DTYPE)
    if not (completion.size == len(mask) == logprobs.size):
        raise BadMessage(f"trajectory {idx}: completion, mask and logprobs lengths differ")
    # The float32 sum of squares (one BLAS call, cheaper than a numpy reduction) is finite when every log-prob
    # is, unless it overflows: then check one by one.
    if not math.isfinite(logprobs.dot(logprobs)) and not np.isfinite(logprobs).all():
        raise BadMessage(f"trajectory {idx}: non-finite behaviour log-prob")
    reward = body.get("reward")
    if reward is not None:
        if type(reward) is not float:
            reward = _get(body, "reward", float, optional=True)
        if not math.isfinite(reward):
            raise BadMessage(f"trajectory {idx}: reward is {reward}, not a finite number")
    for x in latencies:
        if type(x) is not float and type(x) is not int:
            raise BadMessage(f"trajectory {idx}: tool_latency_s holds a {type(x).__name__}, not a number")
        if not math.isfinite(x):
            raise BadMessage(f"trajectory {idx}: tool_latency_s holds {x}, not a finite number")
    # Positional, in Trajectory's field order: this runs for every sample of every group.
    return Trajectory(idx, completion, np.frombuffer(mask, dtype=MASK_DTYPE), logprobs, text, finish, turns,
                      tool_calls, tuple(map(float, latencies)) if latencies else (), timeouts, reward)
