"""``python -m tasklet.scheduler``: see :mod:`scheduler.cli`."""

import sys

from .cli import main

sys.exit(main())
