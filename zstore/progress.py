"""Progress bars that render in terminals and notebooks, and stay quiet elsewhere.

>>> for _ in progress(range(3), desc="demo", enabled=False):
...     pass
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ipython = shell.get_ipython()
    return ipython is not None and "IPKernelApp" in ipython.config


def _tqdm_class():
    """tqdm's notebook widget where a kernel has ipywidgets, else the text bar."""
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401 - the widget bar needs it
        except ImportError:
            pass  # the text bar renders in a notebook's output too
        else:
            from tqdm.notebook import tqdm

            return tqdm
    from tqdm import tqdm

    return tqdm


def progress(iterable: Iterable[Any] | int | None = None, desc: str | None = None, *,
             total: int | None = None, enabled: bool | None = None, unit: str = "it", **kwargs: Any):
    """A tqdm progress bar over ``iterable`` (or over ``total`` steps: pass an int).

    ``enabled=None`` shows it when stderr is a terminal or the code runs in a
    notebook; ``False`` always hides it (a disabled bar costs nothing).
    Use it as an iterable, or call ``update(n)`` / ``close()`` (or ``with``).

    >>> with progress(total=10, desc="rows", enabled=False) as bar:
    ...     _ = bar.update(10)
    """
    if isinstance(iterable, int):
        iterable, total = None, iterable
    if enabled is None:
        enabled = in_notebook() or (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
    return _tqdm_class()(iterable, desc=desc, total=total, disable=not enabled, unit=unit,
                         dynamic_ncols=True, **kwargs)
