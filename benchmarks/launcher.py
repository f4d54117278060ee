"""Running a benchmark script as a torchrun job of CPU ranks on loopback (the multi-process benchmarks)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from trainmesh.core.env import free_port

CMD_ENV = "TRAINMESH_BENCHMARK_CMD"
"""The command the user typed, for the report (inside the job, sys.argv is torchrun's)."""


def launch(script: str, argv: list[str], nproc: int) -> int:
    """Re-run `script` under torchrun on 127.0.0.1, one thread per rank; returns its exit code."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        script,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", CMD_ENV: shlex.join([sys.executable, *sys.argv])}
    print(f"launching: {shlex.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode


def typed_command() -> str:
    return os.environ.get(CMD_ENV, shlex.join([sys.executable, *sys.argv]))


def timed_run_overrides(size: str, steps: int, cache_dir: str) -> list[str]:
    """trainmesh config overrides for a timed CPU/gloo training: `steps` steps of GPT `size`, a record per step, no
    evaluation, checkpoint, sample or progress bar in between."""
    return [
        f"--model.size={size}",
        f"--train.max_steps={steps}",
        "--run.log_every=1",
        "--train.eval_every=0",
        "--train.eval_samples=16",
        "--checkpoint.final=false",
        "--sample.max_new_tokens=0",
        "--run.progress=false",
        f"--data.cache_dir={cache_dir}",
        "--dist.device=cpu",
        "--dist.backend=gloo",
    ]
