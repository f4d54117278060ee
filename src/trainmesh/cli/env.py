"""`trainmesh env [--full]`: what this machine offers for distributed training, the thing to paste into a bug report."""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.distributed as dist

from trainmesh.core.env import vars_with_prefix
from trainmesh.core.versions import versions

ENV_PREFIXES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_",
    "GROUP_RANK",
    "ROLE_",
    "TORCHELASTIC_",
    "TORCH_",
    "NCCL_",
    "GLOO_",
    "SLURM_",
    "OMPI_COMM_WORLD_",
    "MV2_COMM_WORLD_",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "MPI_LOCAL",
    "PET_",
    "JOB_COMPLETION_INDEX",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "PYTORCH_",
)


def environment_report() -> str:
    lines = ["trainmesh environment", "", "versions:"]
    lines += [f"  {name:<10} {value}" for name, value in versions().items()]
    lines += [f"  {'platform':<10} {platform.platform()}", f"  {'cpu cores':<10} {os.cpu_count()}"]
    lines += ["", "devices:"]
    if torch.cuda.is_available():
        lines.append(f"  cuda {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(
                f"    cuda:{i} {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}"
            )
        lines.append(f"  bf16 supported: {torch.cuda.is_bf16_supported()}")
        if dist.is_nccl_available():
            lines.append(f"  nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
    else:
        lines.append(f"  cuda: not available (torch built with CUDA {torch.version.cuda or 'none'})")
    mps = getattr(torch.backends, "mps", None)
    lines.append(f"  mps: {'available' if mps is not None and mps.is_available() else 'not available'}")
    lines.append(f"  cpu: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch threads")
    lines += ["", "distributed backends:"]
    for name, available in (
        ("nccl", dist.is_nccl_available()),
        ("gloo", dist.is_gloo_available()),
        ("mpi", dist.is_mpi_available()),
        ("ucc", getattr(dist, "is_ucc_available", lambda: False)()),
    ):
        lines.append(f"  {name:<5} {'yes' if available else 'no'}")
    lines += ["", "distributed environment variables:"]
    found = vars_with_prefix(ENV_PREFIXES)
    lines += [f"  {k}={v}" for k, v in found] or ["  (none set: a plain single process)"]
    return "\n".join(lines)


def pytorch_report() -> str:
    """PyTorch's own environment report (`python -m torch.utils.collect_env`): OS, compilers, CUDA and cuDNN,
    the GPU driver, CPU, and the relevant pip and conda packages, for a bug report to trainmesh or PyTorch. Its
    probes (nvidia-smi, pip list, ...) are subprocesses that return at once where the tool is missing, and need
    no network."""
    from torch.utils.collect_env import get_pretty_env_info

    return "PyTorch's report (torch.utils.collect_env)\n\n" + get_pretty_env_info()


def cmd_env(args: argparse.Namespace) -> int:
    print(environment_report())
    if args.full:
        print("\n" + pytorch_report())
    return 0
