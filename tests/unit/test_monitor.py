"""Host and device figures for the metrics, sampled off the training thread."""

from __future__ import annotations

import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from trainmesh.metrics.monitor import Monitor


def test_host_figures_are_sampled_in_the_background() -> None:
    with Monitor(torch.device("cpu"), interval_s=0.02) as monitor:
        first = monitor.take()
        ballast = torch.ones(64, 2**20)  # 256 MiB, touched: the peak resident memory must see it
        time.sleep(0.2)
        second = monitor.take()
        del ballast
    assert set(first) <= {"host_rss_gb", "host_cpu_percent", "host_mem_percent"}  # no GPU here: no gpu_*
    assert "host_cpu_percent" in second  # measured over the thread's interval, never the first call's nothing
    assert 0 < first["host_rss_gb"] < psutil.virtual_memory().total / 2**30
    assert second["host_rss_gb"] > first["host_rss_gb"] + 0.2
    assert 0 < second["host_mem_percent"] <= 100
    assert not monitor._thread.is_alive()  # stopped on exit


def test_a_failing_sampler_stops_with_a_warning_and_never_stops_training(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with Monitor(torch.device("cpu"), interval_s=0.02) as monitor:
        monkeypatch.setattr(psutil, "virtual_memory", lambda: 1 / 0)
        time.sleep(0.1)
        assert monitor._stop.is_set()  # the sampler gave up ...
        assert "host_rss_gb" in monitor.take()  # ... and the last good sample stays
    assert "monitoring stopped: division by zero" in caplog.text


class FakeProcess:
    """psutil.Process giving the resident sizes and CPU figures the test lists, one of each per sample."""

    def __init__(self, rss_gib: list[float], cpu_percent: list[float]) -> None:
        self.rss_gib, self.cpu = rss_gib, cpu_percent

    def memory_info(self) -> SimpleNamespace:
        return SimpleNamespace(rss=self.rss_gib.pop(0) * 2**30)

    def cpu_percent(self) -> float:
        return self.cpu.pop(0)


def test_each_window_has_its_own_peak_and_its_latest_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory that falls shows in the next window (its peak starts over), and the CPU figure is the one psutil gave
    for the interval before, never its first call's 0.0, which covers no interval."""
    process = FakeProcess(rss_gib=[3.0, 2.0, 1.0], cpu_percent=[0.0, 150.0, 50.0])
    monkeypatch.setattr(psutil, "Process", lambda: process)
    monitor = Monitor(torch.device("cpu"))  # not entered: the test samples, not the thread
    monitor._sample()
    first = monitor.take()
    assert first["host_rss_gb"] == 3.0 and "host_cpu_percent" not in first
    monitor._sample()
    monitor._sample()
    second = monitor.take()
    assert (second["host_rss_gb"], second["host_cpu_percent"]) == (2.0, 50.0)  # the peak of 2 then 1, not 3
    assert monitor.take()["host_rss_gb"] == 1.0  # a window without a sample: the latest
