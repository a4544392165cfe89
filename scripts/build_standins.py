"""Build stand-in Qwen2 and Llama models for an environment, optionally warm-started on its demonstrations.

Run by hand (or by the README's own-model example) when a real checkpoint
cannot be downloaded:

    python scripts/build_standins.py OUT_DIR [--env calc|guess|module:Class] [--arch qwen2|llama|both]
                                     [--warm-start] [--seed 0]

Each stand-in (``workers.standin``) has a byte-level BPE tokenizer trained on
the environment's text and a chat template; it goes to OUT_DIR/<arch>, and
with ``--warm-start`` a copy trained on the environment's demonstrations
(``workers.warmstart``) goes to OUT_DIR/<arch>-<env>. The directories are
printed last, one per line.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers import standin  # noqa: E402
from workers.envs import load_env  # noqa: E402
from workers.envs.base import Environment  # noqa: E402
from workers.warmstart import WarmStart, warm_start  # noqa: E402

# Enough text for the BPE to learn every multi-character piece of the task.
CORPUS_EXAMPLES = 2000


def env_corpus(env: Environment, seed: int, n: int = CORPUS_EXAMPLES) -> list[str]:
    """Prompt, clean demonstration turns and the environment's replies of ``n`` training tasks, as plain text."""
    out = []
    for i, task in enumerate(env.make_tasks(seed, n, "train")):
        state, text = env.start(task), task.prompt
        for turn in env.demonstration(task, random.Random(i), noise=0.0):
            reply = env.step(state, task, turn, "stop")
            text += turn + (reply.text or "")
            if reply.done:
                break
        out.append(text)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, help="parent directory; one model directory per architecture goes under it")
    p.add_argument("--env", default="calc", help="the environment whose text trains the tokenizer (env.entry)")
    p.add_argument("--arch", choices=[*standin.FAMILIES, "both"], default="both", help="which family to build")
    p.add_argument("--warm-start", action="store_true", help="also train a copy on the environment's demonstrations")
    p.add_argument("--target", type=float, default=WarmStart.target, help="warm start until this held-out success")
    p.add_argument("--noise", type=float, default=WarmStart.noise, help="share of demonstration turns that go wrong")
    p.add_argument("--seed", type=int, default=0, help="seed of the corpus, the initial weights and the warm start")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = load_env(args.env)
    name = args.env.rpartition(":")[2].lower()
    corpus = env_corpus(env, args.seed)
    archs = list(standin.FAMILIES) if args.arch == "both" else [args.arch]
    built = []
    for arch in archs:
        started = time.monotonic()
        out = standin.build_standin(args.out_dir / arch, arch=arch, corpus=corpus, seed=args.seed)
        print(f"{arch}: built in {time.monotonic() - started:.1f}s", flush=True)
        built.append(out)
        if args.warm_start:
            warm = args.out_dir / f"{arch}-{name}"
            ws = WarmStart(seed=args.seed, target=args.target, noise=args.noise)
            try:
                result = warm_start(out, warm, env, train=env.make_tasks(args.seed, 4000, "train"),
                                    held_out=env.make_tasks(args.seed, ws.eval_size, "eval"), ws=ws,
                                    progress=lambda line, a=arch: print(f"{a} warm start: {line}", flush=True))
            except ValueError as exc:   # an evaluation that judged nothing: no figure to give
                print(f"{arch}: warm start failed: {exc}", file=sys.stderr, flush=True)
                return 1
            print(f"{arch}: warm start {result['steps']} steps, held-out success {result['success']:.2f} "
                  f"in {result['seconds']:.0f}s", flush=True)
            built.append(warm)
    for out in built:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
