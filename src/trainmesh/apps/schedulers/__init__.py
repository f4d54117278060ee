"""Job files for schedulers: `trainmesh slurm` prints an sbatch script, `trainmesh k8s` Kubernetes manifests.

Both check the config first, at every world size the job may run at, as `trainmesh check` does, and print
nothing when a flag or the config needs fixing (exit 2, naming the flag). What the scheduler then starts is
`trainmesh run` (or, with `--one-task-per-gpu`, the per-rank worker) with `--auto-resume` and a run id that
stays the same when the scheduler reruns the job, so a requeued or restarted job continues from its newest
checkpoint.
"""
