"""`trainmesh data prepare`: text, JSON Lines, Parquet or saved datasets -> token shards (trainmesh.data.prepare,
which imports no torch: neither this process nor its tokenising workers load it)."""

from __future__ import annotations

import argparse
import logging

from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_TERMINATED
from trainmesh.core.signals import Terminated, sigterm_raises
from trainmesh.data.prepare import PrepareOptions, prepare

log = logging.getLogger("trainmesh")


def cmd_data(args: argparse.Namespace) -> int:
    """`trainmesh data prepare`."""
    given = {k: getattr(args, k) for k in ("tokenizer", "text_field", "val_fraction", "shard_tokens", "workers")}
    options = PrepareOptions(
        inputs=tuple(args.inputs),
        out=args.out,
        force=args.force,
        progress=not args.no_progress,
        **{k: v for k, v in given.items() if v is not None},
    )
    try:
        with sigterm_raises():  # as Ctrl-C: prepare removes its staging folder (the default would leave it)
            done = prepare(options)
    except KeyboardInterrupt:
        log.warning("interrupted (Ctrl-C): nothing was written to %s", args.out)
        return EXIT_INTERRUPTED
    except Terminated:
        log.warning("terminated (SIGTERM): nothing was written to %s", args.out)
        return EXIT_TERMINATED
    manifest = done.manifest
    for name, split in (("train", manifest.train), ("val", manifest.val)):
        print(f"{name:5} {split.tokens:>15,} tokens in {len(split.shards)} shard(s), {split.documents:,} document(s)")
    print(
        f"wrote {done.folder}; train on it with: trainmesh run gpt --data.source={done.folder} "
        f"--data.tokenizer={manifest.tokenizer.name}"
    )
    return 0
