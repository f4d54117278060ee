"""Products built on the engine: the planner (plan/), scaling benchmarks (bench/), the parity check (parity/) and
the job-file generators (schedulers/). Each is driven by its verb in cli/."""
