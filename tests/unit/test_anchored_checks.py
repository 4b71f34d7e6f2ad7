"""Every identifier weenv checks with a pattern (digests, names, users, hostnames,
cgroup paths) is refused with a trailing newline.

Python's ``$`` also matches before a final ``\\n``: ``"sha256:<64 hex>\\n"``
passed ``check_digest``, ``"task\\n"`` passed ``check_name`` (a ref file or
template name with a newline), ``"h\\n"`` a hostname in config.json and
``"/weenv-x\\n"`` a cgroup directory.  Each check must take the whole string."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from weenv.errors import InvalidInputError
from weenv.formats.manifest import RuntimeConfig, TemplateManifest, check_digest, check_name
from weenv.node.cgroups import CgroupV2
from weenv.node.runtime.bundle import build_config
from weenv.node.runtime.runc import exec_args
from weenv.packaging.importer.source import check_blob_digest

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("tail", ["\n", "\r\n", "\n\n"])
def test_digests_and_names_with_a_trailing_newline_are_refused(tail):
    assert check_digest(DIGEST) == DIGEST
    with pytest.raises(InvalidInputError):
        check_digest(DIGEST + tail)
    with pytest.raises(InvalidInputError):
        check_name("task" + tail)
    with pytest.raises(InvalidInputError):
        check_blob_digest(DIGEST + tail, "layer")
    with pytest.raises(ValidationError):
        TemplateManifest(name="t", groups=[DIGEST + tail])
    with pytest.raises(ValidationError):
        TemplateManifest(name="t" + tail, groups=[DIGEST])


def test_users_with_a_trailing_newline_are_refused():
    with pytest.raises(ValidationError):
        RuntimeConfig(user="0:0\n")
    assert exec_args(["true"], {}, None, "0:0")[1] == ["true"]
    with pytest.raises(InvalidInputError):
        exec_args(["true"], {}, None, "0:0\n")


def test_a_hostname_with_a_trailing_newline_is_refused():
    build_config(Path("/r"), RuntimeConfig(), hostname="h", cgroups_path="/c")
    with pytest.raises(InvalidInputError, match="hostname"):
        build_config(Path("/r"), RuntimeConfig(), hostname="h\n", cgroups_path="/c")


def test_a_cgroup_path_with_a_trailing_newline_is_refused(tmp_path):
    assert CgroupV2("/weenv-x", tmp_path).path == "/weenv-x"
    with pytest.raises(InvalidInputError, match="cgroup path"):
        CgroupV2("/weenv-x\n", tmp_path)
