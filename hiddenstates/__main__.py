"""`python -m hiddenstates` (and `torchrun -m hiddenstates ...`) runs the CLI."""

import sys

from hiddenstates.cli import main

sys.exit(main())
