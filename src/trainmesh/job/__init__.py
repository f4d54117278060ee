"""A job from config to ranks: resolve.py (config + world size -> the frozen Job), rundir.py (RunFolder: the run
folder's whole life; its file locks in locks.py), resume.py (what a resume starts from), launcher.py (the launcher
side of run and check), worker.py (one rank)."""
