"""What the launcher (torchrun) says about this process, read from its environment alone.

No torch here: the command line asks before it knows whether any work is needed.
"""

from __future__ import annotations

import os

__all__ = ["launch_rank", "launched"]


def launched() -> bool:
    """True under a launcher (torchrun) with more than one process."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_rank() -> int:
    """This process's rank as the launcher numbered it (0 without a launcher); known before
    the process group is joined."""
    return int(os.environ["RANK"]) if launched() else 0
