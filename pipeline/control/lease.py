"""The controller's lease: one controller acts at a time.

``Controller`` (``pipeline.control.loop``) takes ``CONTROLLER_LEASE`` with
SET NX PX and renews it every tick; each acquisition takes the next
``CONTROLLER_EPOCH``, which the agents (``pipeline.control.agent``) use as a
fence: an action carrying an older epoch than one they have seen is ignored.
The agent holds its node's lock (``agent_lock``) with the same class, without
an epoch.
"""

from __future__ import annotations

import os
import uuid

import redis

# Take the lease and, only if that worked, the next epoch, in one step. Taken apart (INCR, then
# SET NX), a rival's INCR could land between ours and our SET NX: we would hold the lease with an
# epoch below the current one, and the agents would ignore every action we sent while we held it.
# (On a Redis Cluster the lease and its epoch key would need one hash tag.)
_ACQUIRE = """
if redis.call('exists', KEYS[1]) == 1 then return false end
local epoch = 0
if #KEYS == 2 then epoch = redis.call('incr', KEYS[2]) end
local token = string.format('%d:%s', epoch, ARGV[1])
redis.call('set', KEYS[1], token, 'px', ARGV[2])
return token
"""
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Lease:
    """A Redis lease: taken only while free (with a TTL), renewed and released only while our token is the value.

    With ``epoch_key`` each acquisition takes the next number from that
    counter, in the same step as the lease, and puts it in the token, so
    actions can carry it as a fence: the holder's epoch is always the highest.
    """

    def __init__(self, r: redis.Redis, key: str, ttl_s: float, epoch_key: str | None = None):
        self.r, self.key, self.ttl_ms, self.epoch_key = r, key, int(ttl_s * 1000), epoch_key
        self.token: str | None = None
        self.epoch = 0

    def acquire(self) -> bool:
        """Take the lease if it is free; the token is ``epoch:pid:random`` (epoch 0 without ``epoch_key``)."""
        keys = [self.key, self.epoch_key] if self.epoch_key else [self.key]
        got = self.r.eval(_ACQUIRE, len(keys), *keys, f"{os.getpid()}:{uuid.uuid4().hex}", self.ttl_ms)
        if got is None:
            return False
        self.token = got.decode() if isinstance(got, bytes) else got
        self.epoch = int(self.token.split(":", 1)[0])
        return True

    def renew(self) -> bool:
        """Extend the lease; False (and forgotten) if it expired or another holder has it."""
        if self.token is None:
            return False
        if self.r.eval(_RENEW, 1, self.key, self.token, self.ttl_ms):
            return True
        self.token, self.epoch = None, 0
        return False

    def write(self, queue) -> bool:
        """Run ``queue(pipe)``'s commands as one transaction only while the lease is still ours.

        False, with nothing written, when it lapsed or another holder has it (a
        pause longer than the TTL between a renew and this write): the writes of a
        controller that no longer acts must not overwrite its successor's.
        """
        if self.token is None:
            return False
        with self.r.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) != self.token.encode():
                    self.token, self.epoch = None, 0
                    return False
                pipe.multi()
                queue(pipe)
                pipe.execute()
                return True
            except redis.WatchError:   # taken, renewed or expired meanwhile: not ours to trust
                return False

    def release(self) -> None:
        if self.token is not None:
            self.r.eval(_RELEASE, 1, self.key, self.token)
        self.token, self.epoch = None, 0

    def free(self, token: str) -> bool:
        """Delete the lease if ``token`` (a holder known to be dead) still holds it; never another's."""
        return bool(self.r.eval(_RELEASE, 1, self.key, token))

    @property
    def held(self) -> bool:
        return self.token is not None


