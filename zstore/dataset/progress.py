"""Progress bars for long imports, exports and conversions (tqdm; off when not a terminal)."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, desc: str, enabled: bool | None = None, unit: str = "rows") -> Any:
    """A tqdm bar over ``total`` units on stderr; ``enabled=None`` shows it only on a TTY."""
    from tqdm.auto import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not enabled,
                file=sys.stderr, leave=False)
