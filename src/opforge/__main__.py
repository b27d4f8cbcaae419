"""``python -m opforge ...``: the ``opforge`` command without its installed script."""

import sys

from .cli import main

sys.exit(main())
