"""``python -m asyncpp.serve [MODEL] [options]``: the same as ``asyncpp serve``."""

import sys

from .cli import main

if __name__ == "__main__":  # vLLM spawns its processes: they re-import this module
    sys.exit(main())
