"""``python -m matrixfsdp``: the same as the ``matrixfsdp`` console script."""

from __future__ import annotations

import sys

from .launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
