"""Launching meshloom: a SLURM batch script, and a supervisor that relaunches a run until it completes."""
