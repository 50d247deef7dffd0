"""The lap clock: seconds since the last lap, perf_counter on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from mars_bench.decoding.clock import Clock

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_cpu_laps_are_seconds_since_the_last_lap():
    clock = Clock(torch.device("cpu"))
    assert not clock.cuda
    time.sleep(0.05)
    first = clock.lap()
    second = clock.lap()
    assert 0.045 <= first < 1.0
    assert 0.0 <= second < 0.01  # measured from the previous lap, not from the start


def test_cpu_laps_add_up_to_the_wall_time():
    start = time.perf_counter()
    clock = Clock("cpu")
    laps = []
    for _ in range(4):
        time.sleep(0.01)
        laps.append(clock.lap())
    assert all(lap >= 0.009 for lap in laps)
    assert sum(laps) == pytest.approx(time.perf_counter() - start, abs=0.005)


def test_other_devices_fall_back_to_perf_counter():
    clock = Clock(torch.device("meta"))
    assert not clock.cuda and isinstance(clock.lap(), float)


@CUDA
def test_cuda_laps_time_the_queued_device_work():
    clock = Clock(torch.device("cuda"))
    assert clock.cuda and clock.device.index is not None
    torch.cuda._sleep(int(50e6))  # ~tens of ms of GPU spinning, queued asynchronously
    busy = clock.lap()
    idle = clock.lap()
    assert isinstance(busy, float) and busy > 0.005
    assert 0.0 <= idle < busy


@CUDA
def test_cuda_laps_match_the_wall_clock():
    clock = Clock("cuda:0")
    start = time.perf_counter()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    elapsed = clock.lap()
    wall = time.perf_counter() - start
    assert 0.0 < elapsed <= wall + 0.002
    assert elapsed == pytest.approx(wall, rel=0.5, abs=0.01)
