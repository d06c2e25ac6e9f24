"""``python -m fastpersist.bench``: the same as ``fastpersist bench`` (see :func:`fastpersist.bench.main`)."""

import sys

from . import main

sys.exit(main())
