"""The process a run lives in, before and around the model's own communication.

- ``config.py``:   the run's settings: TOML + dotted overrides, each field's range checked where it is declared
- ``process.py``:  device and backend, the default group, the CPU control plane, timeouts on every group
- ``signals.py``:  SIGTERM/SIGINT: finish the step, save, exit; workers of a dead launcher stop too
- ``failures.py``: the one-line report of a timed-out or broken collective (which phase, which groups)
- ``run_dir.py``:  run.dir checks and the lock that keeps a second live run out
"""
