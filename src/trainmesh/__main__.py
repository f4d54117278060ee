"""`python -m trainmesh <recipe> ...` (also under torchrun -m / srun): run one worker."""

import sys

from trainmesh.core.orphans import end_with_launcher

end_with_launcher()  # first, before torch is imported: a worker whose launcher dies stops at once (core/orphans.py)

from trainmesh.job.worker import main  # noqa: E402

sys.exit(main())
