"""What one benchmark mode yields: ``ModeResult``, and the staleness quantile it reports.

Built by the des engine's modes (``pipeline.sim.sync.simulate_sync``,
``pipeline.sim.des.simulate_async``, the ideal bound in
``pipeline.sim.bench_allocator``) and by the live engine
(``pipeline.sim.bench_live``); ``bench_allocator`` turns each into its entry of
the README's JSON. All in the CLI process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

Progress = Callable[[int, int, float], None]   # (steps done, steps, virtual seconds)


@dataclass
class ModeResult:
    """One mode's outcome; ``report()`` is its entry of the README's JSON."""

    trajectories_per_s: float
    gpu_busy_frac: float | None = None
    learner_wait_frac: float | None = None
    staleness_p50: float | None = None
    staleness_p99: float | None = None
    dropped_stale: int | None = None
    reconfigurations: int | None = None
    final_allocation: dict | None = None
    sim_time_s: float = 0.0
    timeline: list[dict] = field(default_factory=list)   # per learner step: t, allocation, rate
    events: list[dict] = field(default_factory=list)     # libra's decisions that moved GPUs

    def report(self) -> dict:
        """The README's per-mode keys, as plain JSON types (ideal has only its rate)."""
        out = {"trajectories_per_s": float(self.trajectories_per_s)}
        for k in ("gpu_busy_frac", "learner_wait_frac", "staleness_p50", "staleness_p99"):
            if getattr(self, k) is not None:
                out[k] = float(getattr(self, k))
        for k in ("dropped_stale", "reconfigurations"):
            if getattr(self, k) is not None:
                out[k] = int(getattr(self, k))
        if self.final_allocation is not None:
            out["final_allocation"] = {k: int(v) for k, v in self.final_allocation.items()}
        return out


def hist_quantile(hist: np.ndarray, q: float) -> float:
    """The q-quantile of integer values given their counts (lower value at a tie)."""
    total = hist.sum()
    if total == 0:
        return 0.0
    return float(np.searchsorted(np.cumsum(hist), q * total))
