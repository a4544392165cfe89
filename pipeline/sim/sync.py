"""The ``sync`` mode: colocated and synchronous, computed step by step.

Called by ``pipeline.sim.bench_allocator`` (``libra-ctl bench policy``, in the
CLI process) once per run. Every GPU generates the batch in waves, then the
batch is scored, then every GPU trains and publishes and the rollout side loads
the weights; nothing overlaps, so no event engine is needed.
"""

from __future__ import annotations

import math

import numpy as np

from pipeline.sim.result import ModeResult, Progress
from pipeline.sim.workload import Workload


def simulate_sync(wl: Workload, seed: int, progress: Progress | None = None) -> ModeResult:
    """Every GPU generates the batch in waves, then rewards, then every GPU trains, then publish + load."""
    job, ro, le = wl.job, wl.rollout, wl.learner
    g, c = wl.cluster.gpus, ro.concurrency
    rng = np.random.default_rng(seed)
    reward_workers = g if wl.reward.gpu else wl.reward.cpu_workers
    t = busy = wait = 0.0
    timeline = []
    for step in range(job.steps):
        ph = job.phase_at(step)
        resp = ph.response_tokens.sample(rng, job.batch_size)
        slot = resp / ro.decode_tokens_per_s + ph.tool_calls.sample_wait_s(rng, job.batch_size)
        prefill = ph.prompt_tokens / ro.prefill_tokens_per_s
        gen = _sync_generation_s(slot, prefill, g, c)
        reward = math.ceil(job.batch_size / reward_workers) * wl.reward.seconds if wl.reward.seconds else 0.0
        train = (ph.prompt_tokens * job.batch_size + resp.sum()) / (le.train_tokens_per_s * g ** le.scaling_exponent)
        step_s = gen + reward + train + le.weight_publish_s + ro.weight_sync_s
        busy += job.batch_size * prefill + slot.sum() / c + g * (train + le.weight_publish_s)
        busy += job.batch_size * wl.reward.seconds if wl.reward.gpu else 0.0
        wait += gen + reward + ro.weight_sync_s
        t += step_s
        timeline.append({"t": t, "step": step + 1, "rollout": g, "learner": g, "reward": 0,
                         "switching": 0, "rate": job.batch_size / step_s})
        if progress:
            progress(step + 1, job.steps, t)
    return ModeResult(trajectories_per_s=job.steps * job.batch_size / t, gpu_busy_frac=busy / (g * t),
                      learner_wait_frac=wait / t, staleness_p50=0.0, staleness_p99=0.0, dropped_stale=0,
                      reconfigurations=0, final_allocation={"colocated": g}, sim_time_s=t, timeline=timeline)


def _sync_generation_s(slot: np.ndarray, prefill: float, gpus: int, concurrency: int) -> float:
    """Waves of gpus x concurrency sequences; a wave lasts until its slowest GPU is done.

    Sequence j of a wave runs on GPU j % gpus; a GPU first prefills its
    sequences (exclusive time), then its slowest one sets its finish.
    """
    wave = gpus * concurrency
    total = 0.0
    for w0 in range(0, len(slot), wave):
        s = slot[w0:w0 + wave]
        pad = (-len(s)) % gpus
        per_gpu = np.concatenate([s, np.full(pad, -np.inf)]).reshape(-1, gpus)
        count = (per_gpu > -np.inf).sum(axis=0)
        total += float(np.max(count * prefill + per_gpu.max(axis=0)))
    return total
