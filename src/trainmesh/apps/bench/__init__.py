"""`trainmesh bench`: the classic scaling experiment. The same job runs at 1, 2, 4, ... processes, weak (the
batch per rank fixed) or strong (the global batch fixed), each point a real `trainmesh run`-style launch into a
folder of its own; the points' metrics become bench.json, bench.md and scaling.png.

    plan.py     what was asked (modes, process counts, steps) checked against the machine, and the points
    report.py   a point's figures from its metrics.jsonl, speedup and efficiency, the files written at the end
    load.py     how busy the node was around each point (load average, CPU steal), and when that makes it doubtful

The command itself (check everything, claim the bench folder, run the points, report) is cli/bench.py, built on
`trainmesh run`'s launcher (job/launcher.py).
"""
