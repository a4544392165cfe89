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

import msgpack
import numpy as np

SCHEMA_VERSION = 1
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
    answer: int  # ground truth for the verifier; the policy never sees it
    issued_at: float


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
    answer: int
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

    def with_rewards(self, rewards: list[float], scored_at: float) -> "Group":
        trajs = tuple(replace(t, reward=float(r)) for t, r in zip(self.trajectories, rewards))
        return replace(self, trajectories=trajs, scored_at=scored_at)


# --- encoding -----------------------------------------------------------------------------


def encode(msg: Prompt | Group) -> bytes:
    if isinstance(msg, Prompt):
        body = {"kind": "prompt", "prompt_id": msg.prompt_id, "prompt": msg.prompt,
                "answer": msg.answer, "issued_at": msg.issued_at}
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


def _bytes(arr: np.ndarray, dtype: np.dtype) -> bytes:
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
        return Prompt(prompt_id=_get(body, "prompt_id", str), prompt=_get(body, "prompt", str),
                      answer=_get(body, "answer", int), issued_at=_get(body, "issued_at", float))
    if kind == "group":
        return _decode_group(body)
    raise BadMessage(f"unknown message kind {kind!r}")


def _get(body: dict, name: str, typ: type, optional: bool = False):
    if name not in body or (optional and body[name] is None):
        if optional:
            return None
        raise BadMessage(f"missing field {name!r}")
    value = body[name]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise BadMessage(f"field {name!r}: expected {typ.__name__}, got {type(value).__name__}")
    return value


def _array(body: dict, name: str, dtype: np.dtype) -> np.ndarray:
    raw = _get(body, name, bytes)
    if len(raw) % dtype.itemsize:
        raise BadMessage(f"field {name!r}: {len(raw)} bytes is not a whole number of {dtype}")
    return np.frombuffer(raw, dtype=dtype)


def _decode_group(body: dict) -> Group:
    raw_trajs = _get(body, "trajectories", list)
    if not raw_trajs:
        raise BadMessage("empty group: no trajectories")
    trajs = tuple(_decode_traj(t) for t in raw_trajs)
    extra = _get(body, "extra", dict, optional=True) or {}
    return Group(
        prompt_id=_get(body, "prompt_id", str), prompt=_get(body, "prompt", str),
        answer=_get(body, "answer", int), prompt_tokens=_array(body, "prompt_tokens", TOKEN_DTYPE),
        version=_get(body, "version", int), worker=_get(body, "worker", str),
        generated_at=_get(body, "generated_at", float), gen_s=_get(body, "gen_s", float),
        trajectories=trajs, scored_at=_get(body, "scored_at", float, optional=True), extra=extra,
    )


def _decode_traj(body) -> Trajectory:
    if not isinstance(body, dict):
        raise BadMessage("malformed trajectory: not a map")
    completion = _array(body, "completion", TOKEN_DTYPE)
    mask = _array(body, "mask", MASK_DTYPE)
    logprobs = _array(body, "logprobs", LOGPROB_DTYPE)
    idx = _get(body, "sample_idx", int)
    if completion.size == 0:
        raise BadMessage(f"empty trajectory: sample {idx} has no tokens")
    if not (completion.size == mask.size == logprobs.size):
        raise BadMessage(f"trajectory {idx}: completion, mask and logprobs lengths differ")
    if not np.all(np.isfinite(logprobs)):
        raise BadMessage(f"trajectory {idx}: non-finite behaviour log-prob")
    reward = _get(body, "reward", float, optional=True)
    if reward is not None and not math.isfinite(reward):
        raise BadMessage(f"trajectory {idx}: reward is {reward}, not a finite number")
    latencies = _get(body, "tool_latency_s", list)
    return Trajectory(
        sample_idx=idx, completion=completion, mask=mask, logprobs=logprobs,
        text=_get(body, "text", str), finish=_get(body, "finish", str),
        turns=_get(body, "turns", int), tool_calls=_get(body, "tool_calls", int),
        tool_latency_s=tuple(float(x) for x in latencies),
        tool_timeouts=_get(body, "tool_timeouts", int), reward=reward,
    )
