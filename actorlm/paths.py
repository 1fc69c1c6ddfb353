"""Where actorlm keeps what it builds once per machine (dequantized models, compiled kernels)."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """``$XDG_CACHE_HOME/actorlm``, by default ``~/.cache/actorlm``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "actorlm"
