"""``python -m app.cli``: the ``sinkserve`` command (``app/cli/__init__.py``)."""

import sys

from app.cli import main

sys.exit(main())
