"""`trainmesh env [--full]`: what this machine offers trainmesh, to paste into a bug report."""

from __future__ import annotations

import argparse

from trainmesh.core.report import environment_report, pytorch_report


def cmd_env(args: argparse.Namespace) -> int:
    print(environment_report())
    if args.full:
        print("\n" + pytorch_report())
    return 0
