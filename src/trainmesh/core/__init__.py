"""The bottom layer, importing nothing of trainmesh above it: where this process sits in the job (env.py), process
groups (dist.py), rank-aware logging, errors and exit codes (errors.py), safe file writes (files.py), stop signals
(signals.py), batch arithmetic (batch.py), versions (versions.py)."""
