"""Write the calculator task's prompt files (examples/data/), deterministically from a seed.

Usage: python scripts/make_prompts.py [--train N] [--eval N] [--seed S] [--out DIR]
The files are shipped in the repository; this script is how they were made.
"""

import argparse
from pathlib import Path

from workers.envs.calc import make_problems, write_prompt_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--eval", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("examples/data"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_prompt_file(args.out / "calc_train.jsonl", make_problems(args.seed, args.train, "train"))
    write_prompt_file(args.out / "calc_eval.jsonl", make_problems(args.seed, args.eval, "eval"))
    print(f"wrote {args.train} train and {args.eval} eval prompts to {args.out}")


if __name__ == "__main__":
    main()
