"""Where eaglespec keeps downloaded models.

`$EAGLESPEC_HOME` when set, else the platform's user cache.
"""

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """The root cache directory (created on first use by whoever writes into it)."""
    home = os.environ.get("EAGLESPEC_HOME")
    if home:
        return Path(home).expanduser()
    return Path(platformdirs.user_cache_dir("eaglespec"))
