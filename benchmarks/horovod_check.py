"""trainmesh.horovod's check before each collective (docs/horovod.md, "The check before each collective"): what it
costs per hvd.allreduce, against the same call with TRAINMESH_HOROVOD_CHECK=0 and against a plain
`dist.all_reduce` (the PyTorch baseline), on 2 gloo ranks on loopback.

Rounds alternate the three ways; each figure is the median over rounds of the slower rank's time per call.

    python benchmarks/horovod_check.py [--rounds 5 --calls 200 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import trainmesh.compat.horovod as hvd
from trainmesh.launch.spawn import run_distributed

SIZES = {"1 element": 1, "4 MiB": 1 << 20}


def _per_call(call: Callable[[], object], calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def _rank(rank: int, rounds: int, calls: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for check in ("1", "0"):
            os.environ["TRAINMESH_HOROVOD_CHECK"] = check  # read by hvd.init()
            hvd.init()
            for label, numel in SIZES.items():
                tensor = torch.ones(numel)
                n = calls if numel == 1 else max(1, calls // 10)
                key = f"{label}, hvd check={'on' if check == '1' else 'off'}"
                times.setdefault(key, []).append(_per_call(lambda t=tensor: hvd.allreduce(t, op=hvd.Sum), n))
                if check == "0":
                    key = f"{label}, dist.all_reduce"
                    times.setdefault(key, []).append(_per_call(lambda t=tensor: dist.all_reduce(t.clone()), n))
            hvd.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ranks = run_distributed(_rank, 2, args=(args.rounds, args.calls), timeout_s=600)
    result: dict[str, Any] = {}
    for key in ranks[0]:
        slower = [max(a, b) for a, b in zip(ranks[0][key], ranks[1][key], strict=True)]
        result[key] = statistics.median(slower) * 1e6
    for label in SIZES:
        on, off, raw = (result[f"{label}, {way}"] for way in ("hvd check=on", "hvd check=off", "dist.all_reduce"))
        timings = f"check on {on:8.0f} us, off {off:8.0f} us, dist.all_reduce {raw:8.0f} us"
        print(f"{label:>10}: {timings}; on/off {on / off:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
