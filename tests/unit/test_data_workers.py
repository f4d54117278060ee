"""DataLoader workers ignore the stop signals and still run the loader's own worker_init_fn."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal

import torch
from torch.utils.data import DataLoader, Dataset

from trainmesh.data.workers import Batches, WorkerInit, worker_init


class _Report(Dataset[tuple[int, int, int]]):
    """Each item: what the worker process does with SIGTERM and SIGINT, and whether its own init ran."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        return (
            int(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN),
            int(signal.getsignal(signal.SIGINT) == signal.SIG_IGN),
            int(os.environ.get("TM_TEST_INIT_RAN", "0")),
        )


def _own_init(worker_id: int) -> None:
    os.environ["TM_TEST_INIT_RAN"] = "1"


def test_loader_workers_ignore_sigterm_and_sigint_and_run_the_chained_init() -> None:
    loader = DataLoader(_Report(), batch_size=2, num_workers=1, worker_init_fn=worker_init(_own_init))
    (batch,) = list(loader)
    assert torch.equal(batch[0], torch.tensor([1, 1])) and torch.equal(batch[1], torch.tensor([1, 1]))
    assert torch.equal(batch[2], torch.tensor([1, 1]))
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # the training process itself is untouched


def test_wrapping_twice_adds_nothing_and_it_pickles() -> None:
    once = worker_init(_own_init)
    assert worker_init(once) is once and isinstance(once, WorkerInit)
    assert pickle.loads(pickle.dumps(once)).then is _own_init


def test_closing_the_batches_ends_the_workers_even_while_a_traceback_holds_them() -> None:
    """An error's traceback keeps the frames that held the batches: `close` must end the workers regardless (the
    exit would otherwise wait forever on workers that ignore SIGTERM)."""
    loader = DataLoader(_Report(), batch_size=1, num_workers=1, worker_init_fn=worker_init())
    batches = Batches(loader)
    next(batches)
    workers = multiprocessing.active_children()
    assert workers

    def fail() -> None:
        held = batches  # a frame holding them, kept by the traceback below
        raise RuntimeError(f"failed while holding {held}")

    try:
        fail()
    except RuntimeError as e:
        kept = e.__traceback__  # as sys.last_traceback or a logged exception keeps it
        batches.close()
        for worker in workers:
            worker.join(timeout=10)
        assert kept is not None and not any(w.is_alive() for w in workers)
