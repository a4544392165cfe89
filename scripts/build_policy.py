"""Build and warm-start the tiny policy into a cache directory, printing progress.

Run by hand or by the demo setup before a run starts:

    python scripts/build_policy.py --cache-dir .cache/policies --seed 0 [--eval 200]

Prints the model directory on the last line. A second run with the same spec
finds the cached policy and returns at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers import tiny_policy
from workers.envs import load_env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", default=".cache/policies", help="where built policies are kept, one directory per spec hash")
    p.add_argument("--seed", type=int, help="seed of the initial weights and the warm start (default: the "
                                          "spec's seed, else 0)")
    p.add_argument("--spec", default="{}", help="JSON object overriding tiny_policy.DEFAULT_SPEC keys")
    p.add_argument("--eval", type=int, default=0, metavar="N", help="also report greedy success on N eval problems (torch)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = json.loads(args.spec)
    except ValueError as exc:
        raise SystemExit(f"--spec {args.spec!r} is not JSON ({exc}): give an object, e.g. '{{\"hidden_size\": 256}}'")
    if not isinstance(spec, dict):
        raise SystemExit(f"--spec {args.spec!r}: give a JSON object, e.g. '{{\"hidden_size\": 256}}'")
    if args.seed is not None:
        if spec.get("seed", args.seed) != args.seed:
            raise SystemExit(f"--seed {args.seed} and the spec's seed {spec['seed']} differ: give one")
        spec["seed"] = args.seed
    spec.setdefault("seed", 0)
    started = time.monotonic()
    try:
        tiny_policy.full_spec(spec)   # an unknown key or a value the build cannot use: said, not a traceback
    except ValueError as exc:
        raise SystemExit(f"--spec: {exc}") from None
    model_dir = tiny_policy.ensure_policy(args.cache_dir, spec, progress=lambda msg: print(msg, flush=True))
    print(f"ready in {time.monotonic() - started:.1f}s", flush=True)
    if args.eval:
        problems = load_env(tiny_policy.WARM_ENV).make_tasks(spec["seed"] + 1, args.eval, "eval")
        print(f"greedy success on {args.eval} eval problems: {tiny_policy.torch_success(model_dir, problems):.3f}", flush=True)
    print(model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
