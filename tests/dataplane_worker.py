"""A reward-stage process for the data-plane tests: ``run_stage`` over rollouts -> scored, no verifier.

``python -m tests.dataplane_worker --url URL --job J --consumer C [--sleep-s S]``
runs the production loop (reclaim, read, decode and validate, handle, write
and acknowledge in one transaction, deduplication marks, trimming) with a
handler that sleeps ``S`` seconds per batch and then gives every sample the
reward 1.0. Started by tests/test_dataplane.py, which kills it with SIGKILL
or stops it with SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from pipeline.dataplane import messages
from pipeline.dataplane.keys import GROUP_REWARD, JobKeys
from pipeline.dataplane.redisconn import connect
from pipeline.dataplane.streams import ClaimPolicy, Dedup, Reject, ensure_groups, run_stage


def main() -> None:
    p = argparse.ArgumentParser(prog="tests.dataplane_worker")
    p.add_argument("--url", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--consumer", required=True)
    p.add_argument("--sleep-s", type=float, default=0.0, help="handler time per batch")
    p.add_argument("--min-idle-ms", type=int, default=1000)
    p.add_argument("--max-deliveries", type=int, default=3)
    p.add_argument("--max-bytes", type=int, default=1 << 20)
    p.add_argument("--count", type=int, default=16)
    args = p.parse_args()

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    r, keys = connect(args.url), JobKeys(args.job)
    ensure_groups(r, keys)

    def handle(groups: list) -> list:
        time.sleep(args.sleep_s)
        out = []
        for g in groups:
            if not isinstance(g, messages.Group) or any(t.reward is not None for t in g.trajectories):
                out.append(Reject("reward stage expects an unscored group"))
            else:
                out.append(g.with_rewards([1.0] * len(g.trajectories), time.time()))
        return out

    print("ready", flush=True)
    run_stage(r, keys, source=keys.rollouts, group=GROUP_REWARD, consumer=args.consumer, sink=keys.scored,
              handle=handle, count=args.count, block_ms=100, max_bytes=args.max_bytes,
              claims=ClaimPolicy(min_idle_ms=args.min_idle_ms, max_deliveries=args.max_deliveries),
              stop=stopping.is_set, counter="scored", dedup=Dedup("reward", 600))


if __name__ == "__main__":
    main()
