"""A job from config to ranks: resolve.py (config + world size -> the frozen Job), rundir.py (the run folder's
life), resume.py (what a resume starts from), launcher.py (the launcher side of run and check), worker.py (one
rank)."""
