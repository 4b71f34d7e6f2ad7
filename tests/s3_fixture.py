"""SeaweedFS on loopback for tests (:mod:`weenv_bench.services.seaweedfs`: a
``weed server -s3`` with its data in a temporary directory, stopped by PID).

Fixtures (``tests/conftest.py`` imports them, so that every module shares one):

- ``s3_server`` (session): one server shared by a test session, its
  credentials in the environment (``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY``, as a user sets them; put back after the session);
  give each test its own prefix (:func:`new_prefix`).
"""

from __future__ import annotations

import itertools
import os

import pytest

from daemon_fixture import environ
from weenv_bench.services.seaweedfs import BUCKET, CREDENTIALS, Seaweed

__all__ = ["BUCKET", "Seaweed", "new_prefix", "s3_server"]

_prefixes = itertools.count()


def new_prefix(base: str = "t") -> str:
    """A prefix not used before in this process."""
    return f"{base}{os.getpid()}-{next(_prefixes)}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A SeaweedFS S3 server shared by the session (give each test its own prefix)."""
    with environ(**CREDENTIALS), Seaweed(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
    assert server.process is None  # stopped and reaped
