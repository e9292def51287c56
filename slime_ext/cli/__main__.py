"""``python -m slime_ext.cli ...`` -- the same as the ``slime-ext`` console script."""

import sys

from . import main

sys.exit(main())
