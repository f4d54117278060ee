"""`trainmesh check --parity`: two trainings compared step by step (command.py), per quantity (compare.py)."""
