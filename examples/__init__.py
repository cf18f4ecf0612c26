"""Small runnable scripts: chapter 0's foundations, a from-scratch version of each parallelism, fp16 with loss
scaling, and trainer/: one trainer grown a mechanism at a time.

Each distributed script runs on 2 gloo ranks in seconds (``torchrun --standalone --nproc-per-node 2
examples/X.py``) and imports nothing but torch. Each has a ``run()`` function that does the work on an already
initialised process group and returns what it printed, so the tests can run it through
``launch/spawn.py: run_on_ranks`` (tests/test_examples.py) and compare the from-scratch versions with meshloom's
API path (tests/test_from_scratch.py). ``mixed_precision_fp16.py`` does not communicate: ``python
examples/mixed_precision_fp16.py`` runs it as one process.
"""
