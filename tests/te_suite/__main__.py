"""``python3 -m tests.te_suite``: see :mod:`tests.te_suite.harness`."""

import sys

from .harness import main

sys.exit(main())
