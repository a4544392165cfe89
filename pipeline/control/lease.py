"""The controller's lease: one controller acts at a time.

``Controller`` (``pipeline.control.loop``) takes ``CONTROLLER_LEASE`` with
SET NX PX and renews it every tick; each acquisition takes the next
``CONTROLLER_EPOCH``, which the agents (``pipeline.control.agent``) use as a
fence: an action carrying an older epoch than one they have seen is ignored.
"""

from __future__ import annotations

import os
import uuid

import redis

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Lease:
    """A Redis lease: SET NX PX to take it, renew and release only while our token is the value.

    With ``epoch_key`` each acquisition takes the next number from that
    counter and puts it in the token, so actions can carry it as a fence.
    """

    def __init__(self, r: redis.Redis, key: str, ttl_s: float, epoch_key: str | None = None):
        self.r, self.key, self.ttl_ms, self.epoch_key = r, key, int(ttl_s * 1000), epoch_key
        self.token: str | None = None
        self.epoch = 0

    def acquire(self) -> bool:
        epoch = int(self.r.incr(self.epoch_key)) if self.epoch_key and self.r.get(self.key) is None else 0
        token = f"{epoch}:{os.getpid()}:{uuid.uuid4().hex}"
        if self.r.set(self.key, token, nx=True, px=self.ttl_ms):
            self.token, self.epoch = token, epoch
            return True
        return False

    def renew(self) -> bool:
        """Extend the lease; False (and forgotten) if it expired or another holder has it."""
        if self.token is None:
            return False
        if self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms):
            return True
        self.token, self.epoch = None, 0
        return False

    def release(self) -> None:
        if self.token is not None:
            self.r.eval(_RELEASE, 1, self.key, self.token)
        self.token, self.epoch = None, 0

    @property
    def held(self) -> bool:
        return self.token is not None


