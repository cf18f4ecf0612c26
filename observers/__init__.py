"""What watches a run without changing it: the profiler, the rank-balance clock, the pipeline timeline, the replica
check; each attached through the step's hooks (base.py), chosen by the config in one registry (registry.py)."""
