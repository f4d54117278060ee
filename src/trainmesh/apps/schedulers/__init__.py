"""Job files for schedulers: `trainmesh slurm` prints an sbatch script, `trainmesh k8s` Kubernetes manifests. Both check
the config first; the job runs `trainmesh run --auto-resume` under a run id that survives a requeue.

Details: docs/internals.md#appsschedulers__init__py
"""
