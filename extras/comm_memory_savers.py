"""Kept only for planning/options.py's import while the planning room is rewritten; delete with that import.

Each saver lives in its own file: extras/reduce_once_per_step.py, bf16_reduction.py, powersgd.py, cpu_offload.py.
"""

from extras.bf16_reduction import reduce_dtype
from extras.cpu_offload import offload_policy
from extras.powersgd import apply_powersgd

__all__ = ["apply_powersgd", "offload_policy", "reduce_dtype"]
