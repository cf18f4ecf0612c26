"""The layout planner's command at its first name: ``python -m bench.plan_layout ...`` is
``python -m planning.plan_layout ...`` (every option it takes; the planner is arithmetic and lives in planning/).

What activation checkpointing keeps, measured, is ``python -m bench.activation_memory --ac``.
"""

from planning.plan_layout import main

if __name__ == "__main__":
    main()
