import sys

from hiddenstates.cli import main

sys.exit(main())
