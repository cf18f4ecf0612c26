import os

# One intra-op thread per process: ranks share two cores, and more threads were measured 3-6x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
