"""Write an environment's prompt files (examples/data/), deterministically from a seed.

Usage: python scripts/make_prompts.py [--env calc|guess|module:Class] [--train N] [--eval N] [--seed S] [--out DIR]
Writes OUT/<name>_train.jsonl and OUT/<name>_eval.jsonl with the environment's
``make_tasks``. The calculator's and the guessing game's files are shipped in
the repository; this script is how they were made.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run with any Python: `python scripts/...`

from pipeline import argtypes   # noqa: E402
from workers.envs import EnvError, load_env   # noqa: E402
from workers.envs.base import write_prompt_file   # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="calc", help="the environment (an env.entry value)")
    p.add_argument("--name", help="file name prefix (default: the environment's class name, lower case)")
    p.add_argument("--train", type=argtypes.count, default=4000, help="training prompts (the shipped files: "
                   "calc 4000, guess 2000)")
    p.add_argument("--eval", type=argtypes.count, default=500, help="held-out prompts (calc 500, guess 200)")
    p.add_argument("--seed", type=argtypes.whole, default=0)
    p.add_argument("--out", type=Path, default=Path("examples/data"))
    args = p.parse_args()
    try:
        env = load_env(args.env)
    except EnvError as exc:
        p.error(str(exc))
    name = args.name or args.env.rpartition(":")[2].lower()
    args.out.mkdir(parents=True, exist_ok=True)
    write_prompt_file(args.out / f"{name}_train.jsonl", env.make_tasks(args.seed, args.train, "train"))
    write_prompt_file(args.out / f"{name}_eval.jsonl", env.make_tasks(args.seed, args.eval, "eval"))
    print(f"wrote {args.train} train and {args.eval} eval prompts to {args.out}/{name}_*.jsonl")


if __name__ == "__main__":
    main()
