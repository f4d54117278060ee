"""The bottom layer: what every other part of trainmesh stands on, importing nothing of trainmesh above it.

Where this process sits in the job (env.py), process-group plumbing (dist.py), rank-aware logging,
exit codes and the user-error type (errors.py), safe file writes (files.py), stop signals in commands
that have nothing to save (signals.py), the batch arithmetic (batch.py) and version reports (versions.py,
report.py).
"""
