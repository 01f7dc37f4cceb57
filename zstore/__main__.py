"""``python -m zstore``: the ``zstore`` console command."""

import sys

from .cli import main

sys.exit(main())
