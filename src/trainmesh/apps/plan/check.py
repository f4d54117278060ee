"""The memory line of `trainmesh check`: the plan's prediction for the job as configured, on this machine's devices; it
reads no calibration file.

Details: docs/internals.md#appsplancheckpy
"""

from __future__ import annotations

import dataclasses

import torch

from trainmesh.apps.plan.cluster import PRESETS, Cluster, GiB, size_unit
from trainmesh.apps.plan.estimate import Estimate, estimate_layout
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.config.schema import FSDPConfig
from trainmesh.core.machine import host_memory
from trainmesh.job.spec import Job
from trainmesh.recipes.gpt.model import GPTConfig

LOCAL = "this machine"


def local_cluster(processes_per_node: int) -> Cluster:
    """This machine as a one-node cluster with `processes_per_node` ranks."""
    base = dataclasses.replace(PRESETS["h100"], name=LOCAL, devices_per_node=processes_per_node)
    if torch.cuda.is_available():
        return dataclasses.replace(base, memory=float(torch.cuda.get_device_properties(0).total_memory))
    return dataclasses.replace(base, device="cpu", memory=host_memory() / processes_per_node, overhead=0.0)


def predict(job: Job, cluster: Cluster) -> Estimate | None:
    """The estimate of `job`'s layout, of which `check` shows the memory (None for recipes the plan does not
    model)."""
    config, model = job.config, job.config.model
    if not isinstance(model, GPTConfig):
        return None
    # fp8-mixed as bf16-mixed: the same fp32 model states and bf16 activations; of its float8 layers it keeps no
    # autocast bf16 weight copies, but casts each layer's input and weight to float8 for a moment (memory_lines says so)
    name = config.train.precision
    precision = PrecisionBytes("bf16-mixed" if name == "fp8-mixed" else name)
    cand, accum = Candidate.from_job(job), job.batch.accum_steps
    return estimate_layout(ModelSpec(model), cand, precision, cluster, accum, config.train.tf32)


def where_from(cluster: Cluster) -> str:
    return " here" if cluster.name.startswith(LOCAL) else f" of {cluster.name}"


def memory_lines(job: Job, cluster: Cluster) -> list[str]:
    """One line with the prediction by component on `cluster`'s devices (local_cluster: this machine's), and a
    warning line when it exceeds their usable memory."""
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
    if job.config.train.precision == "fp8-mixed":
        lines.append("  (fp8-mixed predicted as bf16-mixed, which holds the same model states and activations)")
    if isinstance(job.config.model, GPTConfig) and job.config.model.loss_chunk_tokens:
        lines.append(
            "  (model.loss_chunk_tokens is not modelled: predicted with the head's logits whole, more than the fused "
            "head holds; --dry-run measures it)"
        )
    if not est.fits:
        lines.append(
            f"  WARNING: that is more than the {cluster.usable_memory / GiB:.1f} GiB usable of the "
            f"{cluster.memory / GiB:.1f} GiB of memory per {cluster.device} rank{where_from(cluster)} "
            f"({cluster.memory_margin:.0%} "
            "kept for what is not modelled). Fix: see `trainmesh plan` for layouts that fit (fsdp, activation "
            "checkpointing, a smaller train.micro_batch)."
        )
    return lines


def choose_gradient_mode(jobs: list[Job], cluster: Cluster) -> tuple[list[Job], str]:
    """`jobs` (one per world size of a launch) with parallel.fsdp.reduce_every_microstep=auto decided for `cluster`'s
    devices, and a line that says what was chosen and why ('' where nothing was left to decide). Of the two modes,
    the faster of those that fit; where neither fits, the one that needs less memory. Decided on the smallest world
    size where the mode changes anything, where a rank holds the most (every world size runs with one config). The
    gpt recipe only (the plan's); others hold whole gradients."""
    fsdp = jobs[0].config.parallel.fsdp
    if fsdp.reduce_every_microstep is not None:
        return jobs, ""
    matters = [job for job in sorted(jobs, key=lambda j: j.world_size) if job.gradient_mode_matters]
    both = [_both_modes(job, cluster) for job in matters]  # no estimate where nothing is decided: a launch's second
    # where the mode changes anything (fsdp sharding, accumulating): the smallest such world size
    decided = [(held, sharded) for held, sharded in both if held and sharded and held.candidate != sharded.candidate]
    if not decided:
        every, why = False, ""
    else:
        held, sharded = decided[0]
        fitting = [e for e in (held, sharded) if e.fits]
        best = min(fitting, key=lambda e: e.step_time) if fitting else min((held, sharded), key=_total)
        every = best is sharded
        unit, scale = size_unit(max(held.total_memory, sharded.total_memory))
        why = (
            f"parallel.fsdp.reduce_every_microstep=auto: {str(every).lower()} — whole gradients "
            f"{held.total_memory / scale:.2f} {unit} per rank, {held.step_time:.3g} s a step; sharded "
            f"{sharded.total_memory / scale:.2f} {unit}, {sharded.step_time:.3g} s; usable "
            f"{cluster.usable_memory / scale:.2f} {unit}{where_from(cluster)} (trainmesh plan's estimate)"
        )
    chosen = dataclasses.replace(fsdp, reduce_every_microstep=every)
    return [_with_fsdp(job, chosen) for job in jobs], why


def _total(est: Estimate) -> float:
    return est.total_memory


def _both_modes(job: Job, cluster: Cluster) -> tuple[Estimate | None, Estimate | None]:
    """The estimates of `job` holding whole gradients and reduce-scattering every micro-step (None: not planned)."""
    held = predict(
        _with_fsdp(job, dataclasses.replace(job.config.parallel.fsdp, reduce_every_microstep=False)), cluster
    )
    every = dataclasses.replace(job.config.parallel.fsdp, reduce_every_microstep=True)
    return held, predict(_with_fsdp(job, every), cluster)


def _with_fsdp(job: Job, fsdp: FSDPConfig) -> Job:
    config = job.config
    return dataclasses.replace(
        job, config=dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, fsdp=fsdp))
    )
