"""One command for a GPU machine: every GPU check meshloom has, within 8 minutes on one GPU, with a report.

    python3 -m bench.gpu_check --out "$OUT/gpu_check" --budget 480                     # from the repository root
    python3 -m bench.gpu_check --out "$OUT/gpu_check" --only NAME1,NAME2 --budget 240  # rerun some, time left

The checks, how each runs apart with a hard limit, and the report: measure/gpu_check.py (standard library only at
module level: it runs where nothing can be installed).
"""

import sys

from measure.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
