"""`trainmesh check --parity`: two trainings compared step by step (cli/parity.py), per quantity (compare.py)."""
