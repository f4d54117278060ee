"""Suite-wide settings: one thread per process, no launch settings from a pod the suite may run in, and `gpu`
tests skipped where CUDA is absent."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# A CI runner in a Kubernetes pod: launches would wait for host names to resolve (launch.IN_KUBERNETES) and take
# the pod's PET_ launch flags. Tests that need them set them.
for key in [k for k in os.environ if k == "KUBERNETES_SERVICE_HOST" or k.startswith("PET_")]:
    del os.environ[key]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
