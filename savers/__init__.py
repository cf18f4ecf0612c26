"""What changes how gradients travel, to save communication or memory; a file each, none through the step's hooks.

Each saver is switched on by one config key and plugged in at the one place that key is read:

- ``parallel.grad_sync step``: reduce_once_per_step.py's ``reduction_window``, around each micro-batch in
  training/step.py (the data-parallel reduction runs on the last micro-batch only);
- ``parallel.grad_compression powersgd``: powersgd.py's ``apply_powersgd``, where the model is parallelized
  (training/build.py builds mesh/parallelize.py's ``ParallelOptions``): a replicated model in FSDP's place;
- ``parallel.grad_compression onebit_adam``: onebit_adam.py's ``OneBitAdam`` replaces the optimizer
  (training/optimizer.py: ``Optimizers``); ``onebit_adam_errors`` refuses the layouts it cannot serve;
- ``parallel.grad_compression bf16`` and ``parallel.fsdp_cpu_offload`` need no file: FSDP options
  (``reduce_dtype``, ``offload_policy``) set in training/build.py.
"""
