"""trainmesh.horovod's build queries return what Horovod's do: nccl_built() is NCCL's version code, which scripts and
Horovod's own tests compare with versions (its alltoall tests skip when `0 < hvd.nccl_built() < 2700`)."""

from __future__ import annotations

import pytest
import torch

import trainmesh.horovod as hvd


@pytest.mark.parametrize(
    ("version", "code"), [((2, 27, 3), 22703), ((2, 9, 6), 20906), ((2, 8, 4), 2804), ((2, 7, 8), 2708)]
)
def test_nccl_built_is_nccls_version_code(monkeypatch: pytest.MonkeyPatch, version: tuple[int, ...], code: int) -> None:
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    assert hvd.nccl_built() == code and type(hvd.nccl_built()) is int


def test_nccl_built_is_0_without_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert hvd.nccl_built() == 0 and type(hvd.nccl_built()) is int
