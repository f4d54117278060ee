"""The public `Runtime` object: a process's device, precision and strategy, and its collectives."""
