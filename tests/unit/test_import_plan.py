"""Image import's pure parts: the image's USER resolved against its passwd and
group files, layers planned into groups, names from sources."""

from __future__ import annotations

import pytest

from weenv.errors import InvalidInputError
from weenv.packaging.importer import default_name, plan_groups
from weenv.packaging.importer.runtime import resolve_user


def test_resolve_user():
    files = {
        "/etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nsvc:x:1001:1002::/srv:/bin/false\n",
        "/etc/group": b"root:x:0:\nstaff:x:50:\n",
    }
    read = files.get
    assert resolve_user("", read) == (0, 0, "/root")
    assert resolve_user("svc", read) == (1001, 1002, "/srv")
    assert resolve_user("svc:staff", read) == (1001, 50, "/srv")
    assert resolve_user("4242", read) == (4242, 0, "/")
    assert resolve_user("4242:7", read) == (4242, 7, "/")
    with pytest.raises(InvalidInputError, match="ghost"):
        resolve_user("ghost", read)
    with pytest.raises(InvalidInputError, match="nogroup"):
        resolve_user("svc:nogroup", read)


def test_plan_groups_and_names():
    assert plan_groups([5, 5, 5]) == [[0], [1], [2]]
    assert plan_groups([100, 1, 2, 3, 100, 4], merge_small=10) == [[0], [1, 2, 3], [4], [5]]
    assert plan_groups([6, 6, 6], merge_small=10) == [[0], [1], [2]]
    assert plan_groups([4, 4, 4], merge_small=10) == [[0, 1], [2]]
    with pytest.raises(InvalidInputError):
        plan_groups([1], merge_small=0)
    assert default_name("docker://127.0.0.1:5000/team/My_Image:3.1") == "my_image"
    assert default_name("/x/python-3.11.tar") == "python-3.11"
