"""Write an environment's prompt files (examples/data/), deterministically from a seed.

Usage: python scripts/make_prompts.py [--env calc|guess|module:Class] [--train N] [--eval N] [--seed S] [--out DIR]
Writes OUT/<name>_train.jsonl and OUT/<name>_eval.jsonl with the environment's
``make_tasks``. The calculator's and the guessing game's files are shipped in
the repository; this script is how they were made.
"""

import argparse
from pathlib import Path

from workers.envs import load_env
from workers.envs.base import write_prompt_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", default="calc", help="the environment (an env.entry value)")
    p.add_argument("--name", help="file name prefix (default: the --env value)")
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("examples/data"))
    args = p.parse_args()
    env = load_env(args.env)
    name = args.name or args.env.rpartition(":")[2].lower()
    args.out.mkdir(parents=True, exist_ok=True)
    write_prompt_file(args.out / f"{name}_train.jsonl", env.make_tasks(args.seed, args.train, "train"))
    write_prompt_file(args.out / f"{name}_eval.jsonl", env.make_tasks(args.seed, args.eval, "eval"))
    print(f"wrote {args.train} train and {args.eval} eval prompts to {args.out}/{name}_*.jsonl")


if __name__ == "__main__":
    main()
