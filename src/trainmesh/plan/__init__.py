"""`trainmesh plan`: memory and speed predicted before launch (memory.py so far)."""
