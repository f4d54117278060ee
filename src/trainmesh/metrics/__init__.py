"""Metrics: progress bar, JSONL/TensorBoard sinks, plots, MFU."""
