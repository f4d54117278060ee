"""`python -m trainmesh.cli ...`: the `trainmesh` command (as installed by pip: trainmesh.cli:main)."""

import sys

from trainmesh.cli import main

sys.exit(main())
