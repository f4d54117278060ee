"""A job from config to ranks: spec.py (config + world size -> the frozen Job), rundir.py (RunFolder: the run
folder's whole life; its file locks in locks.py), resume.py (what a resume starts from), launcher.py (the launcher
side of run and check), worker.py (one rank)."""

from trainmesh.job.spec import Job, check_data, load_config, resolve

__all__ = ["Job", "check_data", "load_config", "resolve"]
