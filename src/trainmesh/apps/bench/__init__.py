"""`trainmesh bench`: the same job at 1, 2, 4, ... processes, weak or strong scaling, each point a real launch; the
points' metrics become bench.json, bench.md and scaling.png. Parts: points.py, report.py, load.py; the command is
cli/bench.py.

Details: docs/internals.md#appsbench__init__py
"""
