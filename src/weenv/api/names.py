"""Domain names as the wire contract takes them (an ``allow_out`` entry) and
the node's name server matches them (:mod:`weenv.node.runtime.nameserver`)."""

from __future__ import annotations

import re

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")


def domain(value: str) -> str | None:
    """``value`` as a lowercase domain pattern (``example.com``, ``*.example.com``:
    subdomains at any depth, not the name itself), None if it is not one."""
    name = value.strip().lower().rstrip(".")
    body = name[2:] if name.startswith("*.") else name
    labels = body.split(".")
    if len(name) > 253 or len(labels) < 2 or not all(_LABEL.match(x) for x in labels) or labels[-1].isdigit():
        return None
    return name
