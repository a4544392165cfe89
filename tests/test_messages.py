import math

import msgpack
import numpy as np
import pytest

from pipeline.dataplane import messages as m


def group(n=2, reward=None):
    trajs = tuple(m.Trajectory(sample_idx=i, completion=np.array([5, 6, 7], np.int32),
                               mask=np.array([1, 0, 1], np.uint8),
                               logprobs=np.array([-0.5, 0.0, -1.25], np.float32), text="abc",
                               finish="answer", turns=1, tool_calls=1, tool_latency_s=(0.01,),
                               tool_timeouts=0, reward=reward) for i in range(n))
    return m.Group(prompt_id="p1@0", prompt="Q:1+2\n", answer=3, prompt_tokens=np.array([1, 2], np.int32),
                   version=4, worker="rollout-x-0", generated_at=1.0, gen_s=0.5, trajectories=trajs)


def test_group_round_trip_keeps_arrays_as_bytes():
    g = group(reward=1.0)
    payload = m.encode(g)
    raw = msgpack.unpackb(payload)
    assert isinstance(raw["trajectories"][0]["completion"], bytes)
    back = m.decode(payload, 1 << 20)
    assert back.version == 4 and back.rewards == [1.0, 1.0]
    assert back.trajectories[1].completion.tolist() == [5, 6, 7]
    assert back.trajectories[0].logprobs.dtype == np.float32


def test_prompt_round_trip():
    p = m.Prompt("p@0", "Q:1+2\n", 3, 2.0)
    assert m.decode(m.encode(p), 1000) == p
    stamped = m.Prompt("p@1", "Q:1+2\n", 3, 2.0, min_version=7)
    assert m.decode(m.encode(stamped), 1000).min_version == 7
    # a prompt from a feeder that did not stamp it: any weights will do
    legacy = {"v": 1, "kind": "prompt", "prompt_id": "p", "prompt": "x", "answer": 1, "issued_at": 0.0}
    assert m.decode(msgpack.packb(legacy), 1000).min_version == 0
    for bad in (-1, "3", 1.5):
        with pytest.raises(m.BadMessage, match="min_version"):
            m.decode(msgpack.packb({**legacy, "min_version": bad}), 1000)


@pytest.mark.parametrize("payload,reason", [
    (b"\xc1\xc1", "malformed msgpack"),
    (msgpack.packb([1, 2]), "not a map"),
    (msgpack.packb({"v": 99, "kind": "prompt"}), "unknown schema version"),
    (msgpack.packb({"v": 1, "kind": "prompt", "prompt": "x", "answer": 1, "issued_at": 0.0}), "missing field 'prompt_id'"),
    (msgpack.packb({"v": 1, "kind": "prompt", "prompt_id": 7, "prompt": "x", "answer": 1, "issued_at": 0.0}), "expected str"),
    (msgpack.packb({"v": 1, "kind": "nope"}), "unknown message kind"),
])
def test_bad_payloads_name_the_reason(payload, reason):
    with pytest.raises(m.BadMessage) as exc:
        m.decode(payload, 1 << 20)
    assert reason in exc.value.reason


def test_oversized_nan_and_empty_are_rejected():
    with pytest.raises(m.BadMessage, match="oversized"):
        m.decode(m.encode(group()), 10)
    with pytest.raises(m.BadMessage, match="not a finite number"):
        m.decode(m.encode(group(reward=math.nan)), 1 << 20)
    with pytest.raises(m.BadMessage, match="empty group"):
        m.decode(m.encode(group(n=0)), 1 << 20)
    two = group(n=2)
    twins = m.Group(**{**two.__dict__, "trajectories": (two.trajectories[0], two.trajectories[0])})
    with pytest.raises(m.BadMessage, match="repeated sample_idx 0"):
        m.decode(m.encode(twins), 1 << 20)
    empty = group()
    t = empty.trajectories[0]
    bad = m.Group(**{**empty.__dict__, "trajectories": (m.Trajectory(**{**t.__dict__,
                  "completion": np.zeros(0, np.int32), "mask": np.zeros(0, np.uint8),
                  "logprobs": np.zeros(0, np.float32)}),)})
    with pytest.raises(m.BadMessage, match="empty trajectory"):
        m.decode(m.encode(bad), 1 << 20)
