"""`trainmesh plan`: memory per rank and step time predicted for every layout of a job on a cluster, before launch
(docs/plan.md). model.py (the parameter table), memory.py and activations.py (bytes), stage_parts.py, rank_memory.py
and estimate.py (one layout), layouts.py and search.py (all of them), cluster.py and calibrate.py (the machines),
check.py (`trainmesh check`'s memory lines). The command is cli/plan.py."""
