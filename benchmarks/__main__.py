"""``python -m benchmarks``: the same as ``keyserial bench``."""

import sys

from .cli import main

sys.exit(main())
