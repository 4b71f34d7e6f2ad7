"""RL groups from one task state: a task's setup run once, a GRPO group forked from it.

::

    import weenv

    task = weenv.Task("my-task", setup=["pip install -e /workspace", "pytest --collect-only -q"])
    with weenv.rollout_group(task, 16) as group:        # 16 sandboxes with the setup's files
        for sb in group:
            sb.commands.run("...")                       # each rollout's own writes
    print(group.state.built, group.tally.share)          # built now or reused; the group's tax

A **task** (:class:`Task`) is a template and a setup: shell commands run in
order in a fresh environment of the template, or a callable given the
sandbox (``key=`` required: weenv cannot tell when a callable changed).  Its
**state** is the setup's result published as a snapshot (one more layer group
on the template's, :mod:`weenv.node.state.snapshot`) under a name derived from the
template's digest and the setup's key (:func:`state_name`: the commands'
digest, or the given key).  The snapshot is a template ref in the store, so
the state is found again by name after a daemon restart, on another node of
the store and in the next training iteration, and ``weenv gc`` keeps it while
the ref is there (``Sandbox.delete_snapshot(group.state.name)`` lets it go).

:func:`rollout_group` (and ``async_rollout_group``) finds or builds the state,
keeps one **root** environment made from it per node (paused with its memory
released; the task remembers it), and forks the group from the root: a child
costs a copy of the root's upper-dir metadata, not a create.  A setup that
fails (an exit code other than 0, an exception of the callable, or its
``timeout`` passed) raises :class:`~weenv.errors.SetupError` with the command
and its output, and leaves no environment and no ref.  A state whose snapshot
is gone from the store (deleted) is rebuilt, and the group says so
(:attr:`TaskState.rebuilt`, and a warning in the log).

:class:`Tree` (and ``AsyncTree``) is the tree-search helper: ``branch(sb, b)``
forks ``b`` children, ``save(sb)`` snapshots a state, ``reset(sb, saved)``
goes back to it in place.  A group and a tree each hold a
:func:`weenv.meter` open for their life: ``.tally`` is their environment tax
(meters are process-wide: calls made meanwhile by other code count too).

This module holds what both faces share; the faces are
:mod:`weenv.sdk._groups_async` and its generated twin :mod:`weenv.sdk._groups_sync`.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weenv.api.models import TemplateInfo
from weenv.errors import InvalidInputError, SetupError
from weenv.sdk._core import Call, CommandResult, Flow

DEFAULT_SETUP_TIMEOUT_S = 600.0
"""Seconds a setup may take, all its commands together, unless the task says otherwise."""
DEFAULT_KEEP_S = 3600.0
"""Seconds a node's root environment of a task lives (a later group makes a new one)."""
SETUP_SLACK_S = 60.0
"""The setup environment lives this much past the setup's timeout (its snapshot is taken after)."""
OUTPUT_TAIL = 4000
"""Characters of a failed command's stdout and stderr (each, the last ones) its error quotes."""
TASK_LABEL = "weenv.task-state"
"""Metadata key of a task's setup and root environments: the state's name."""


@dataclass(eq=False)
class Task:
    """A template and the setup every rollout of it starts after.

    ``setup``: a shell command, a list of them (run in order, each must exit 0),
    or a callable taking the sandbox (on the async face it may be a coroutine
    function); a callable needs ``key`` (any string: change it when the
    setup changes).  ``timeout``: seconds the whole setup may take.  ``envs``:
    variables of the setup's commands.  ``keep``: seconds a node's root
    environment of the task lives."""

    template: str
    setup: str | list[str] | Callable[[Any], Any] | None = None
    key: str | None = None
    timeout: float = DEFAULT_SETUP_TIMEOUT_S
    envs: dict[str, str] = field(default_factory=dict)
    keep: float = DEFAULT_KEEP_S
    _roots: dict[tuple[str, str], str] = field(default_factory=dict, repr=False)
    """(node, state digest) -> the root environment's id on that node."""
    _built: dict[str, str] = field(default_factory=dict, repr=False)
    """State name -> digest, for the states this process has seen (a gone one is said so)."""

    def __post_init__(self):
        if not isinstance(self.template, str) or not self.template:
            raise InvalidInputError(f"a task needs a template name, not {self.template!r}")
        if isinstance(self.setup, str):
            self.setup = [self.setup]
        if callable(self.setup):
            if not isinstance(self.key, str) or not self.key:
                raise InvalidInputError(
                    "a callable setup needs key= (a string that changes when the setup "
                    "does): weenv cannot tell when a function changed"
                )
        elif self.setup is None:
            self.setup = []
        elif not isinstance(self.setup, list) or not all(isinstance(c, str) and c.strip() for c in self.setup):
            raise InvalidInputError(
                f"a task's setup is a command, a list of commands or a callable, not {self.setup!r}"
            )
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise InvalidInputError(f"a task's key is a non-empty string, not {self.key!r}")
        for what in ("timeout", "keep"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidInputError(f"a task's {what} is a positive number of seconds, not {value!r}")

    @property
    def setup_key(self) -> str:
        """The given key, else the digest of the commands (and their variables)."""
        if self.key is not None:
            return self.key
        text = json.dumps({"commands": self.setup, "envs": self.envs}, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass
class TaskState:
    """A task's state as a group found it."""

    name: str
    """The snapshot's template name (``Sandbox.create(name)`` starts it anywhere the store is)."""
    digest: str
    """The snapshot's template manifest digest."""
    template_digest: str
    key: str
    built: bool = False
    """Whether this call ran the setup (False: the store had it)."""
    build_s: float = 0.0
    rebuilt: str | None = None
    """Why it was built again, when the snapshot this process saw is gone from the store."""


def state_name(template: str, template_digest: str, key: str) -> str:
    """The name of the state of a template (by digest) after a setup (by key):
    ``<template>-state-<16 hex>``, a valid template name."""
    h = hashlib.sha256(f"{template_digest}\n{key}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^a-z0-9._-]+", "-", template.lower()).strip("-._")[:96] or "task"
    return f"{stem}-state-{h}"


def check_group_size(n: Any) -> int:
    """``n``; :class:`InvalidInputError` unless a positive int (the node checks its fork maximum)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidInputError(f"bad group size {n!r}: want 1 or more environments (up to the node's fork maximum)")
    return n


def check_branches(b: Any) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise InvalidInputError(f"bad branch count {b!r}: want 1 or more")
    return b


def template_info(name: str) -> Flow[TemplateInfo]:
    """The node's record of template ``name``; :class:`NotFoundError` if the store has none."""
    reply = yield Call("GET", "/templates/" + urllib.parse.quote(name, safe=""))
    return TemplateInfo.model_validate_json(reply.content)


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_TAIL else "..." + text[-OUTPUT_TAIL:]


def failed_command(task: Task, command: str, result: CommandResult) -> SetupError:
    return SetupError(
        f"the setup of task {task.template!r} failed: {command!r} exited {result.exit_code}\n"
        f"--- stdout ---\n{_tail(result.stdout)}\n--- stderr ---\n{_tail(result.stderr)}"
    )


def timed_out(task: Task, command: str | None) -> SetupError:
    what = f"at {command!r}" if command else "in its callable"
    return SetupError(
        f"the setup of task {task.template!r} did not finish within its timeout of "
        f"{task.timeout:g} s ({what}); nothing of it is left"
    )


def failed_callable(task: Task, exc: BaseException) -> SetupError:
    return SetupError(f"the setup of task {task.template!r} failed: its callable raised {type(exc).__name__}: {exc}")


def first_error(children: list[Any]) -> BaseException | None:
    return next((c for c in children if isinstance(c, BaseException)), None)
