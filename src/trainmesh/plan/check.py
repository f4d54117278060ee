"""The memory line of `trainmesh check`: the plan's prediction for the job as configured, on this machine's devices.

The device memory is this machine's: the first GPU's, else the host memory shared by the node's processes. The
fixed overhead per process is the saved calibration's (`trainmesh plan --calibrate`) when there is one for this
kind of device, else the GPU presets' 1 GiB (nothing on a CPU).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from trainmesh.job import Job
from trainmesh.plan.cluster import PRESETS, Cluster, GiB, calibration_path, load_calibration, size_unit
from trainmesh.plan.estimate import Estimate, Precision, memory
from trainmesh.plan.layouts import Candidate
from trainmesh.plan.model import ModelSpec
from trainmesh.recipes.gpt.model import GPTConfig


def local_cluster(processes_per_node: int) -> Cluster:
    """This machine as a one-node cluster with `processes_per_node` ranks."""
    path = calibration_path()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    saved = load_calibration(path) if path.is_file() else None
    base = saved if saved is not None and saved.device == device else PRESETS["h100"]
    if device == "cuda":
        total = float(torch.cuda.get_device_properties(0).total_memory)
        return dataclasses.replace(base, memory=total, devices_per_node=processes_per_node)
    overhead = base.overhead if base.device == "cpu" else 0.0
    return dataclasses.replace(
        base,
        device="cpu",
        memory=_host_memory() / processes_per_node,
        devices_per_node=processes_per_node,
        overhead=overhead,
    )


def _host_memory() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def predict(job: Job, cluster: Cluster) -> Estimate | None:
    """The most loaded rank's memory for `job` (None for recipes the plan does not model)."""
    if not isinstance(job.config.model, GPTConfig):
        return None
    return memory(
        ModelSpec(job.config.model),
        Candidate.from_job(job),
        Precision(job.config.train.precision),
        cluster,
        job.batch.accum_steps,
    )


def memory_lines(job: Job, processes_per_node: int) -> list[str]:
    """One line with the prediction by component, and a warning line when it exceeds the device memory."""
    cluster = local_cluster(processes_per_node)
    est = predict(job, cluster)
    if est is None:
        return [f"  memory: not predicted for recipe {job.config.run.recipe!r} (trainmesh plan models the gpt recipe)"]
    m = est.memory
    unit, scale = size_unit(est.total_memory)
    parts = ", ".join(f"{k} {m[k] / scale:.2f}" for k in ("params", "grads", "optimizer", "activations"))
    extra = (m["gathered"] + m["temporaries"]) / scale
    where = f" (pipeline stage {est.stage})" if job.layout.dims.pp > 1 else ""
    host = f"; host {est.host / scale:.2f} {unit}" if est.host else ""
    lines = [
        f"  memory per rank, predicted{where}: {est.total_memory / scale:.2f} {unit} = {parts}, temporaries "
        f"{extra:.2f}, overhead {m['overhead'] / scale:.2f} {unit}{host}"
    ]
    if not est.fits:
        lines.append(
            f"  WARNING: that is more than the {cluster.memory / GiB:.1f} GiB of memory per {cluster.device} rank "
            "here. Fix: see `trainmesh plan` for layouts that fit (fsdp, activation checkpointing, a smaller "
            "train.micro_batch)."
        )
    return lines
