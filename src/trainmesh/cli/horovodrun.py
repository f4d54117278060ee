"""`trainmesh horovodrun ...`: horovodrun's own flags (-np, and the command after them), not argparse's."""

from __future__ import annotations

import logging

from trainmesh.compat import horovodrun
from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, UserError

log = logging.getLogger("trainmesh")


def cmd_horovodrun(argv: list[str]) -> int:
    """`trainmesh horovodrun ...`: parse horovodrun's flags and launch the command on every rank."""
    try:
        args = horovodrun.parse(argv)
        if args is None:
            print(horovodrun.USAGE)
            return 0
        return horovodrun.launch_horovodrun(args)
    except UserError as e:
        log.error("%s", e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        log.warning("interrupted (Ctrl-C) before the workers started")
        return EXIT_INTERRUPTED
