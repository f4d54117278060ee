"""Runtime: where this process sits in the job, its device, and the public Runtime object."""
