"""``python -m mlx_mla.compare``."""

import sys

from . import main

sys.exit(main())
