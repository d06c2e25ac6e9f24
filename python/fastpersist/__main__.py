"""``python -m fastpersist`` = the ``fastpersist`` command."""

import sys

from .tools.cli import main

sys.exit(main())
