"""`python -m pipejax`: the command line, as the `pipejax` script runs it."""

import sys

from pipejax.cli import main

sys.exit(main())
