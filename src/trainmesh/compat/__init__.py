"""Other frameworks on trainmesh: Horovod's PyTorch API (horovod/, also importable as `trainmesh.horovod`) and
its horovodrun (horovodrun.py), and Ray Train (ray.py: install `ray[train]` yourself, trainmesh does not need it)."""
