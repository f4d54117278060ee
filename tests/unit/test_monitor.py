"""Host and device figures for the metrics, sampled off the training thread."""

from __future__ import annotations

import time

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
    assert second["host_cpu_percent"] >= 0 and 0 < second["host_mem_percent"] <= 100
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
