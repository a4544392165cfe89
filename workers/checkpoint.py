"""The learner's files: checkpoints it restores from and the weights it publishes.

Written by ``workers.learner`` (the learner process, rank 0); its other
ranks (``workers.ranks``) read a restored checkpoint's optimizer. A
checkpoint is a directory ``step-NNNNNN`` holding ``model/``,
``optimizer.pt``, ``consumed.txt`` and ``dropped.txt`` (trajectory ids, one a
line; ``dropped_branch.txt`` names those of the dropped ids that came from a
discarded branch of the version tree) and ``state.json`` (step, version, the
version tree ``lineage``, totals, and ``weights_sha256``, the digest of the
weights as they were in memory: a restore compares it with the weights it
loaded): the whole learner state whatever its world size
(every rank holds the same weights and optimizer state, and rank 0 consumed
every id), so a learner restores it on any number of slots. Published
weights are directories ``vNNNNNN``. Both are written under a ``.tmp`` name
and renamed, so a reader (a restart, a rollout worker loading weights) never
sees half a directory. Both carry the tokenizer files of the directory the
model was loaded from (``source_dir``), so either is a complete model
directory, and both load on a CPU-only machine whatever device the learner
trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from workers.tiny_policy import save_weights


def numbered(paths, prefix: str) -> list[tuple[int, Path]]:
    """(number, path) of the ``<prefix><digits>`` names among ``paths``, by number: a step or a version
    past 999,999 has a seventh digit, and names would sort it first."""
    out = [(int(p.name[len(prefix):]), p) for p in paths if p.name[len(prefix):].isdigit()]
    return sorted(out)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    done = [p for _n, p in numbered(ckpt_dir.glob("step-*"), "step-") if (p / "state.json").exists()]
    return done[-1] if done else None


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "state.json").read_text())


def read_optimizer(ckpt: Path) -> dict:
    # On the CPU: the optimizer's load_state_dict moves each state to its parameter's device.
    return torch.load(ckpt / "optimizer.pt", weights_only=True, map_location="cpu")


def recorded_ids_after(ckpt_dir: Path, after_step: int, record: str) -> dict[str, int]:
    """Trajectory id -> step, for the ids in ``record`` of every complete checkpoint after ``after_step``:
    ``consumed.txt`` (trained) or ``dropped.txt`` (dropped as stale)."""
    ids = {}
    for ckpt in sorted(ckpt_dir.glob("step-*")):
        state_file = ckpt / "state.json"
        if ckpt.name.endswith(".tmp") or not state_file.exists() or not (ckpt / record).exists():
            continue
        step = json.loads(state_file.read_text())["step"]
        if step > after_step:
            for tid in (ckpt / record).read_text().split():
                ids[tid] = step
    return ids


def write_checkpoint(ckpt_dir: Path, model, optimizer, consumed: list[str], dropped: list[str], state: dict,
                     source_dir: Path, dropped_branch: list[str] = ()) -> None:
    """Write ``step-<state["step"]>`` and make it durable (fsynced, renamed, parent fsynced) before returning.

    The caller acknowledges stream entries only after this returns: a crash
    before the rename leaves them pending, to be replayed.
    """
    final = ckpt_dir / f"step-{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    remove_partial(ckpt_dir, "step-")
    tmp.mkdir(parents=True)
    save_weights(model, tmp / "model", source_dir)
    torch.save(_on_cpu(optimizer.state_dict()), tmp / "optimizer.pt")
    (tmp / "consumed.txt").write_text("".join(f"{i}\n" for i in consumed))
    (tmp / "dropped.txt").write_text("".join(f"{i}\n" for i in dropped))
    (tmp / "dropped_branch.txt").write_text("".join(f"{i}\n" for i in dropped_branch))
    (tmp / "state.json").write_text(json.dumps(state))
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_tree(ckpt_dir, recurse=False)


def weights_digest(model) -> str:
    """SHA-256 of the model's parameters (names, dtypes, shapes, bytes), one tensor at a time on the host.

    A checkpoint records it and a restore compares it with the weights it loaded: weights that do not load
    as they were written (a damaged file, a load that took other weights) stop the learner, not its run.
    The cost is one pass over the weights (about 0.3 s per GB on a CPU core), once per checkpoint.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        t = p.detach().reshape(-1).contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(p.shape)};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def write_published(pub_dir: Path, version: int, model, source_dir: Path) -> Path:
    """Write the weights of ``version`` as ``v<version>``, replacing any earlier set under that name."""
    final = pub_dir / f"v{version:06d}"
    tmp = final.with_name(final.name + ".tmp")
    remove_partial(pub_dir, "v")
    save_weights(model, tmp, source_dir)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def announcement(version: int, path: Path, step: int) -> dict:
    """The fields of the job's policy hash (``JobKeys.policy``) that announce published weights.

    Written by the learner after ``write_published`` (and by ``libra-ctl
    bench rollout``, which publishes as the learner does); rollout workers
    read ``version`` and ``path`` between engine calls and reload.
    """
    return {"version": version, "path": str(Path(path).resolve()), "step": step, "published_at": time.time()}


def newest_published(pub_dir: Path) -> int:
    """The highest version number among the weights written to ``pub_dir`` (0: none), half-written ones too."""
    names = (p.name.removesuffix(".tmp") for p in pub_dir.glob("v*"))
    return max((int(n[1:]) for n in names if n[1:].isdigit()), default=0)


def prune_published(pub_dir: Path, keep: int) -> None:
    for _n, old in numbered(pub_dir.glob("v*"), "v")[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def remove_partial(directory: Path, prefix: str) -> None:
    """Remove the half-written ``<prefix>N.tmp`` directories a killed write left (only the learner writes
    here, one write at a time, so any found before a write is debris; a restart numbers past it, and no
    later write of the same name would clear it)."""
    for p in directory.glob(f"{prefix}*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def _on_cpu(obj):
    """A copy of a (nested) state dict with every tensor on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _fsync_tree(path: Path, recurse: bool = True) -> None:
    """fsync ``path`` and, with ``recurse``, everything under it (a new directory before its rename); without,
    the directory alone (its entries: the rename into it)."""
    for p in [path, *path.rglob("*")] if recurse and path.is_dir() else [path]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
