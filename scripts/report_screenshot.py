#!/usr/bin/env python3
"""Write a run's report.html and a PNG screenshot of it (the README's picture of the report).

    scripts/report_screenshot.py RUN_DIR OUT.png [--width 1400] [--height 1700]

Needs headless Chromium (Debian: apt-get install chromium). Nothing is fetched:
the report is self-contained and Chromium runs with networking features off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.observe.report import find_chromium, screenshot, write_report  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1700)
    args = p.parse_args()
    if find_chromium() is None:
        print("no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 1
    page = write_report(args.run_dir)
    png = screenshot(page, args.out, args.width, args.height)
    print(f"{page}\n{png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
