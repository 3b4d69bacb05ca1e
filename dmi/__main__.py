"""``python -m dmi`` runs the ``dmi`` command line (same as the console script)."""

import sys

from dmi.cli import main

sys.exit(main())
