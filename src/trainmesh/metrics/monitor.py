"""Host and GPU monitoring for the metrics, sampled by a thread of its own every few seconds, so the training thread
never waits for it (or syncs the GPU).

Details: docs/internals.md#metricsmonitorpy
"""

from __future__ import annotations

import threading
from typing import Any

import psutil
import torch

from trainmesh.core.logging import get_logger

log = get_logger(__name__)

INTERVAL_S = 2.0


class Monitor:
    """A context manager: sampling runs while it is entered; `take()` returns the window's figures."""

    def __init__(self, device: torch.device, interval_s: float = INTERVAL_S) -> None:
        self.device, self.interval_s = device, interval_s
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._latest: dict[str, float] = {}
        self._peak_rss_gb = 0.0
        self._cpu_started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainmesh-monitor", daemon=True)
        self._gpu_readers = self._nvml_readers() if device.type == "cuda" else {}

    def __enter__(self) -> Monitor:
        self._sample()  # its CPU figure only starts the interval the thread's first sample measures
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s)  # a daemon: a hung NVML call cannot hold the exit

    def take(self) -> dict[str, float]:
        """The latest sample, with this window's peak resident memory (the next window's starts over)."""
        with self._lock:
            figures = dict(self._latest)
            if self._peak_rss_gb:
                figures["host_rss_gb"] = self._peak_rss_gb
            self._peak_rss_gb = 0.0
        if self.device.type == "cuda":
            figures["gpu_reserved_gb"] = torch.cuda.memory_reserved(self.device) / 2**30
        return figures

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            rss_gb = self._process.memory_info().rss / 2**30
            cpu = self._process.cpu_percent()  # since the previous call: the first call has no interval yet
            sample = {"host_rss_gb": rss_gb, "host_mem_percent": psutil.virtual_memory().percent}
            if self._cpu_started:
                sample["host_cpu_percent"] = cpu
            self._cpu_started = True
            sample |= {name: float(read(self.device)) for name, read in self._gpu_readers.items()}
        except Exception as e:  # a monitor must never stop training; say so, and stop sampling
            log.warning("device and host monitoring stopped: %s", e)
            self._stop.set()
            return
        with self._lock:
            self._latest = sample
            self._peak_rss_gb = max(self._peak_rss_gb, rss_gb)

    @staticmethod
    def _nvml_readers() -> dict[str, Any]:
        readers = {
            "gpu_util_percent": torch.cuda.utilization,
            "gpu_power_w": lambda d: torch.cuda.power_draw(d) / 1000,  # milliwatts
            "gpu_temp_c": torch.cuda.temperature,
        }
        try:
            for read in readers.values():
                read(torch.device("cuda", torch.cuda.current_device()))
        except Exception as e:  # ModuleNotFoundError without nvidia-ml-py; an NVML error on odd drivers
            log.info("GPU utilisation, power and temperature are not in the metrics: %s (pip install nvidia-ml-py)", e)
            return {}
        return readers
