"""Every measurement of `pipejax bench` in one run (the same command).

Run: python benchmarks/run_all.py [--repeats N] [--only SECTION ...] [--out PATH]
"""

import sys

from pipejax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
