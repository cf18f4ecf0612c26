"""The cluster planner, for runs not yet launched: which layout, schedule and batch fit a model on N GPUs and how
fast (``python -m cluster.plan_layout``). It imports the run's plan (planning/); nothing in a run imports it."""
