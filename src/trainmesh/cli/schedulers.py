"""`trainmesh slurm` and `trainmesh k8s`: check the config for the job's world sizes, then print its job file. Nothing
is printed when something needs fixing: the error names the flag (exit 2).

Details: docs/internals.md#clischedulerspy
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import replace
from pathlib import Path, PurePosixPath

from trainmesh.apps.schedulers.common import SchedulerError, breaks_a_line, check_config
from trainmesh.apps.schedulers.kubernetes import RUNS_DIR, K8sJob, render_manifests
from trainmesh.apps.schedulers.slurm import SlurmJob, render_sbatch
from trainmesh.config import dump_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.core.logging import get_logger

log = get_logger(__name__)


def slurm_script(args: argparse.Namespace, overrides: list[str]) -> str:
    """The sbatch script for `trainmesh slurm` (checked before anything is returned)."""
    _require(args.gpus_per_node, "--gpus-per-node N", "the GPUs on each node, one process each")
    job = SlurmJob(
        recipe=args.target,
        config=str(Path(args.config).resolve()) if args.config else "",
        overrides=tuple(overrides),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        python=args.python or sys.executable,
        workdir=str(Path.cwd()),
        time=args.time,
        partition=args.partition,
        account=args.account,
        job_name=args.job_name,
        run_id=args.run_id,
        signal_seconds=args.signal_seconds,
        one_task_per_gpu=args.one_task_per_gpu,
        max_restarts=args.max_restarts,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        exclusive=args.exclusive,
        sbatch_options=tuple(args.sbatch_option or ()),
    )
    job.check()  # the flags first: they are cheaper to check than the config
    run_id = [f"--run.id={args.run_id}"] if args.run_id else []  # checked as run.id is
    config, checked = check_config(
        args.config, [*overrides, *run_id], args.target, [job.nodes * job.gpus_per_node], True
    )
    job = replace(job, num_workers=config.data.num_workers)  # the default --cpus-per-task counts them
    return render_sbatch(job, checked, _command_line(args))


def k8s_manifests(args: argparse.Namespace, overrides: list[str]) -> str:
    """The YAML stream for `trainmesh k8s` (checked before anything is returned)."""
    _require(args.gpus_per_node, "--gpus-per-node N", "the GPUs on each node (pod), one process each")
    _require(args.image, "--image IMAGE", "a container image with trainmesh installed")
    if args.run_id:
        raise SchedulerError(
            f"--run-id={args.run_id!r}: a Kubernetes job's run is named by --name, as its pods and services are. "
            "Fix: --name NAME instead."
        )
    stem = Path(args.config).stem if args.config else args.target
    name = args.name or re.sub(r"[^a-z0-9-]+", "-", f"{args.target}-{stem}".lower()).strip("-")[:40].strip("-")
    job = K8sJob(
        recipe=args.target,
        config_toml="",
        name=name,
        image=args.image or "",
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        kind=args.kind,
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        max_restarts=args.max_restarts,
        namespace=args.namespace,
        pvc=args.pvc,
        grace_seconds=args.grace_seconds,
        cpus=args.cpus,
        memory=args.memory,
    )
    job.check()
    if args.pvc:
        overrides = [*overrides, f"--run.out_dir={RUNS_DIR}"]
    low, high = job.node_range
    worlds = [n * job.gpus_per_node for n in range(low, high + 1)]
    # data.source is where the pods see it (in the image or a volume), not necessarily here: not checked.
    config, checked = check_config(args.config, overrides, args.target, worlds, data_here=False)
    if not args.pvc and not PurePosixPath(config.run.out_dir).is_absolute():
        _refuse_a_pod_local_run_folder(config.run.out_dir, high)
    job = replace(job, config_toml=dump_toml(config_to_dict(config)), num_workers=config.data.num_workers)
    return render_manifests(job, checked, _command_line(args))


def _refuse_a_pod_local_run_folder(out_dir: str, max_pods: int) -> None:
    """Without --pvc, a relative run.out_dir is in each container's own filesystem: a pod that restarts starts
    over, and pods that write one checkpoint together (each its own shards) write it in pieces, on each pod."""
    if max_pods > 1:
        raise SchedulerError(
            f"run.out_dir={out_dir!r} is inside each pod's container, but the {max_pods} pods of this job write "
            "each checkpoint together, each rank its own shards, into one run folder, which a restarted pod resumes "
            "from. Fix: --pvc CLAIM (a ReadWriteMany PersistentVolumeClaim, mounted at /runs as run.out_dir), or "
            "--run.out_dir=/absolute/path on a volume every pod mounts (add the volume to the printed YAML)."
        )
    log.warning(
        "run.out_dir=%r is inside the pod's container: a restarted pod starts the run over, and its checkpoints "
        "are lost with the pod. Keep them with --pvc CLAIM (a PersistentVolumeClaim mounted at /runs).",
        out_dir,
    )


def _require(value: object, flag: str, what: str) -> None:
    if value is None:
        raise SchedulerError(f"{flag} is required: {what}.")


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed, for the job file's first comment: refused when an argument holds a control character
    or a line break (a newline would end the comment and run the rest as a line of the script, or add keys to the
    YAML)."""
    words = getattr(args, "command_line", ["trainmesh", args.command])
    for word in words:
        if breaks_a_line(word):
            raise SchedulerError(
                f"argument {word!r} holds a control character (a newline, a tab, a line separator...): in the job "
                "file it would end a line and start another. Fix: remove it."
            )
    return shlex.join(words)
