"""`trainmesh plan`: memory and speed predicted before launch (memory.py: model states by ZeRO stage;
activations.py: the GPT's activations; so far)."""
