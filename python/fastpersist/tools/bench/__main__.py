"""``python -m fastpersist.tools.bench``: the same as ``fastpersist bench``.

See :func:`fastpersist.tools.bench.main`.
"""

import sys

from . import main

sys.exit(main())
