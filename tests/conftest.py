import os
import sys
from pathlib import Path

# One intra-op thread per process: ranks share two cores, and more threads were measured 3-6x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

torch.set_num_threads(1)
