"""python -m docs.figures: see docs/figures/__init__.py."""

import sys

from docs.figures import main

main(sys.argv[1:])
