"""The flags of `trainmesh slurm` and `trainmesh k8s`: what the job asks of the cluster (argparse only; their values
are checked by trainmesh.apps.schedulers, with messages that say how to fix them)."""

from __future__ import annotations

import argparse


def add_scheduler_flags(parser: argparse.ArgumentParser, command: str, defaults: bool = True) -> None:
    """`trainmesh slurm`'s or `trainmesh k8s`'s own flags; checked by trainmesh.apps.schedulers (messages that say how
    to fix)."""
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g = parser.add_argument_group(command)
    g.add_argument("--nodes", type=int, default=d(1), help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=d(None), help="GPUs on each node, one process each (required)")
    if command == "slurm":
        g.add_argument("--time", default=d(None), help="time limit, e.g. 24:00:00 (default: the partition's)")
        g.add_argument("--partition", default=d(None), help="SLURM partition")
        g.add_argument("--account", default=d(None), help="SLURM account to charge")
        g.add_argument("--job-name", default=d(None), help="SLURM job name (default: the recipe's)")
        g.add_argument(
            "--signal-seconds",
            type=int,
            default=d(120),
            help="SIGTERM this many seconds before the time limit: the job saves, stops and requeues (default 120)",
        )
        g.add_argument(
            "--one-task-per-gpu",
            action="store_true",
            default=d(False),
            help="srun one task per GPU running the per-rank worker, instead of one `trainmesh run` per node",
        )
        g.add_argument("--max-restarts", type=int, default=d(0), help="torchrun restarts on each node (default 0)")
        g.add_argument(
            "--cpus-per-task",
            type=int,
            default=d(None),
            metavar="N",
            help="CPUs for each task (default: 1 + data.num_workers for every rank the task runs: the rank's process "
            "and its DataLoader workers; times --gpus-per-node for the one task per node, once with "
            "--one-task-per-gpu)",
        )
        g.add_argument(
            "--mem",
            default=d(None),
            metavar="SIZE",
            help="memory per node, as sbatch's --mem: 200G, 512000M (no unit: megabytes), 0 for all of it (default: "
            "the partition's)",
        )
        g.add_argument("--exclusive", action="store_true", default=d(False), help="share the nodes with no other job")
        g.add_argument(
            "--sbatch-option",
            action="append",
            default=d(None),
            metavar="OPTION",
            help="one more #SBATCH option, e.g. --sbatch-option=--constraint=h100 (with '='); repeat it for more",
        )
        g.add_argument("--python", default=d(None), help="the Python with trainmesh on the nodes (default: this one)")
    else:
        g.add_argument("--image", default=d(None), help="container image with trainmesh installed (required)")
        g.add_argument("--kind", default=d("pytorchjob"), help="pytorchjob (Kubeflow, default) | jobset")
        g.add_argument("--min-nodes", type=int, default=d(None), help="elastic: fewest nodes to train on (pytorchjob)")
        g.add_argument("--max-nodes", type=int, default=d(None), help="elastic: most nodes to train on (pytorchjob)")
        g.add_argument(
            "--max-restarts",
            type=int,
            default=d(3),
            help="pytorchjob: torchrun restarts of a pod's processes; jobset: restarts of all pods (default 3)",
        )
        g.add_argument(
            "--grace-seconds",
            type=int,
            default=d(120),
            help="the pods' terminationGracePeriodSeconds: time from SIGTERM (preemption, eviction) to SIGKILL in "
            "which the ranks save a checkpoint and stop (default 120)",
        )
        g.add_argument(
            "--cpus",
            default=d(None),
            metavar="N",
            help="CPUs of each pod, requested and its limit: 8, 7.5 or 7500m (default: --gpus-per-node x (1 + "
            "data.num_workers): a core for each rank and each of its DataLoader workers)",
        )
        g.add_argument(
            "--memory",
            default=d(None),
            metavar="SIZE",
            help="memory of each pod, requested and its limit: 256Gi, 200G (default: --gpus-per-node x (16Gi + "
            "data.num_workers x 2Gi); /dev/shm, where the loader workers pass batches, counts in it)",
        )
        g.add_argument("--name", default=d(None), help="the job's name, also its run id (default: recipe-config)")
        g.add_argument("--namespace", default=d(None), help="Kubernetes namespace (default: kubectl's)")
        g.add_argument(
            "--pvc",
            default=d(None),
            help="a ReadWriteMany PersistentVolumeClaim for the run folders (mounted at /runs = run.out_dir): "
            "checkpoints every pod shares, kept across restarts",
        )
