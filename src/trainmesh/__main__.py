"""`python -m trainmesh <recipe> ...` (also under torchrun -m / srun): run one worker."""

import sys

from trainmesh.worker import main

sys.exit(main())
