"""``python -m fastpersist`` = the ``fastpersist`` command."""

import sys

from .cli import main

sys.exit(main())
