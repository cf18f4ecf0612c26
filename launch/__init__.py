"""Launching meshloom: on a cluster (a SLURM batch script, a supervisor that relaunches a run until it
completes) and on this machine (spawned gloo ranks and torchrun runs, which the tests and benches share)."""
