"""Node settings read from the environment (elastic admission, the warm pool)
and the CPU statistics admission uses."""

from __future__ import annotations

import math

import pytest

from weenv.errors import InvalidInputError
from weenv.node.provision.arbiter import CpuMoments, predicted_cpu_peak
from weenv.node.provision.models import ProvisionConfig
from weenv.node.state.pool import pool_size_from_env


@pytest.mark.parametrize(
    "var, value",
    [
        ("WEENV_ADMISSION", "bogus"),
        ("WEENV_ADMISSION", "PEAK"),
        ("WEENV_ADMISSION_SIGMAS", "abc"),
        ("WEENV_ADMISSION_SIGMAS", "-1"),
        ("WEENV_ADMISSION_SIGMAS", "nan"),
        ("WEENV_ADMISSION_SIGMAS", "inf"),
        ("WEENV_ADMISSION_SIGMAS", "1e400"),
    ],
)
def test_bad_admission_setting_is_one_clear_line(monkeypatch, var, value):
    """A bad value used to give pydantic's multi-line dump naming the field, not
    the variable (and inf / 1e400 sigmas were taken)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(InvalidInputError) as exc:
        ProvisionConfig.from_env()
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert var in msg and repr(value) in msg, msg
    assert "pydantic" not in msg, msg


def test_cpu_moments_ignore_non_finite_and_negative_samples():
    """A NaN usage sample made the predicted peak NaN, and a NaN peak admits
    everything (every comparison with NaN is false); a negative one lowered it."""
    m = CpuMoments.of([float("nan"), 1.0, float("inf"), -3.0, 1.0])
    assert all(math.isfinite(x) for x in (m.mean, m.variance, m.peak)), m
    assert m == CpuMoments.of([1.0, 0.0, 1.0])
    peak = predicted_cpu_peak([m, CpuMoments.prior(1.0, 0.25)], 2.0)
    assert math.isfinite(peak) and peak > 0
    assert CpuMoments.of([float("nan")]) == CpuMoments(0.0, 0.0, 0.0)
    with pytest.raises(InvalidInputError):
        CpuMoments.of([])


def test_pool_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("WEENV_POOL_SIZE", "3")
    assert pool_size_from_env() == 3
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv("WEENV_POOL_SIZE", bad)
        with pytest.raises(InvalidInputError, match="WEENV_POOL_SIZE"):
            pool_size_from_env()
