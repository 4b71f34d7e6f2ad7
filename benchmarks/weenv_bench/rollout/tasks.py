"""The rollout benchmark's task set: real projects from PyPI sdists, each with one
injected bug, the tests it breaks and the patch that fixes it.

A :class:`TaskSpec` names a pinned sdist that ships its tests, a **mutation**
(one exact snippet of one function replaced by a wrong one: a flipped
comparison, an off-by-one, a swapped call), the project's own tests that the
mutation makes fail (pytest node ids) and the test-only requirements
(installed into the task's ``deps`` group).  The mutations were chosen by
running each project's whole suite with them; :func:`verify_tasks` checks at
build time, inside a weenv environment built from the task's template, that
the named tests fail with the bug and pass once the fixing patch is applied.

On disk (:func:`prepare_task`, under ``$WEENV_CACHE/bench-rollout/tasks``): the
sdist's tree with the bug applied at ``tree/workspace/NAME`` (the task's source
group), ``fix.patch`` (unified diff, ``patch -p1`` from the project's
directory, undoing the mutation) and ``wrong.patch`` (a patch of the same file
that applies cleanly and does not fix it: what a wrong agent submits).  Sdists
come from :func:`weenv_bench.update.fetch_sdists` (pip, cached).

The template of a task stacks four groups: the shared Debian base
(:func:`~weenv.packaging.debootstrap.debian_rootfs`, as ``weenv demo``), the
shared runtime (pytest installed for Debian's Python 3.11, plus Debian's
``patch`` program), the task's ``deps`` (only for tasks that need test
requirements) and its source.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from weenv.errors import InvalidInputError, RuntimeFailedError

RUNTIME_REQUIREMENTS = ("pytest==8.3.4",)
"""The shared runtime group's Python packages (with their dependencies)."""
PATCH_PACKAGE = "patch"
"""The Debian package whose ``/usr/bin/patch`` goes into the runtime group
(minbase has no ``patch``); fetched with ``apt-get download``."""
PYTEST = "python3 -m pytest -q -x -p no:cacheprovider -o addopts="
"""How tests are run inside an environment (``addopts`` cleared: some projects
add coverage options that need plugins the task does not install)."""
FORMAT = 1
"""Bumped when a task's prepared files would differ for the same spec."""


@dataclass(frozen=True)
class TaskSpec:
    """One task: a pinned sdist, a bug, the tests it breaks."""

    name: str
    """Task name; the project lives at ``/workspace/NAME``."""
    sdist: str
    """Pinned requirement of the sdist (``idna==3.10``)."""
    path: str
    """The mutated file, relative to the project's directory."""
    original: str
    """The exact snippet of that file (it occurs once) ..."""
    mutated: str
    """... and what the bug replaces it with."""
    tests: tuple[str, ...]
    """pytest node ids (relative to the project) that fail with the bug."""
    deps: tuple[str, ...] = ()
    """Test requirements beyond the runtime's (the task's deps group)."""
    pythonpath: str = "."
    """Import root of the project's package, relative to its directory (``src``)."""

    @property
    def workdir(self) -> str:
        return f"/workspace/{self.name}"

    @property
    def env(self) -> dict[str, str]:
        """Variables of the task's runtime: the package is imported from the source."""
        root = self.workdir if self.pythonpath == "." else f"{self.workdir}/{self.pythonpath}"
        return {"PYTHONPATH": root, "PYTHONDONTWRITEBYTECODE": "1"}

    def key(self) -> str:
        """A digest of everything that fixes the prepared task."""
        data = json.dumps(
            [
                FORMAT,
                self.name,
                self.sdist,
                self.path,
                self.original,
                self.mutated,
                list(self.tests),
                list(self.deps),
                self.pythonpath,
            ]
        )
        return hashlib.sha256(data.encode()).hexdigest()[:16]


TASKS: tuple[TaskSpec, ...] = (
    TaskSpec(
        "cachetools",
        "cachetools==5.5.0",
        "src/cachetools/__init__.py",
        "            while self.__currsize + size > maxsize:",
        "            while self.__currsize + size >= maxsize:",
        ("tests/test_cache.py::CacheTest::test_insert", "tests/test_cache.py::CacheTest::test_update"),
        pythonpath="src",
    ),
    TaskSpec(
        "idna",
        "idna==3.10",
        "idna/core.py",
        "    if len(label) > 63:",
        "    if len(label) > 64:",
        ("tests/test_idna.py::IDNATests::test_valid_label_length", "tests/test_idna.py::IDNATests::test_encode"),
    ),
    TaskSpec(
        "inflection",
        "inflection==0.5.1",
        "inflection/__init__.py",
        "        return string[0].lower() + camelize(string)[1:]",
        "        return string[0].lower() + camelize(string)[2:]",
        ("test_inflection.py::test_camelize_with_lower_downcases_the_first_letter",),
    ),
    TaskSpec(
        "jmespath",
        "jmespath==1.0.1",
        "jmespath/visitor.py",
        "            return value[node['value']]",
        "            return value[node['value'] - 1]",
        (
            "tests/test_parser.py::TestParser::test_index",
            "tests/test_parser.py::TestParserWildcards::test_root_indices",
        ),
    ),
    TaskSpec(
        "toolz",
        "toolz==1.0.0",
        "toolz/itertoolz.py",
        "    return itertools.islice(seq, 0, None, n)",
        "    return itertools.islice(seq, 1, None, n)",
        ("toolz/tests/test_itertoolz.py::test_take_nth",),
    ),
    TaskSpec(
        "more-itertools",
        "more-itertools==10.5.0",
        "more_itertools/more.py",
        "    return sum(compress(repeat(1), zip(iterable)))",
        "    return sum(compress(repeat(1), zip(iterable))) - 1",
        ("tests/test_more.py::IlenTests::test_ilen",),
    ),
    TaskSpec(
        "semver",
        "semver==3.0.2",
        "src/semver/version.py",
        "        return cls(self._major, self._minor, self._patch + 1)",
        "        return cls(self._major, self._minor + 1, self._patch)",
        ("tests/test_bump.py::test_should_bump_patch", "tests/test_bump.py::test_should_ignore_extensions_for_bump"),
        pythonpath="src",
    ),
    TaskSpec(
        "wcwidth",
        "wcwidth==0.2.13",
        "wcwidth/wcwidth.py",
        "            idx += 2",
        "            idx += 1",
        (
            "tests/test_emojis.py::test_another_emoji_zwj_sequence",
            "tests/test_emojis.py::test_longer_emoji_zwj_sequence",
        ),
    ),
    TaskSpec(
        "python-dateutil",
        "python-dateutil==2.9.0.post0",
        "src/dateutil/easter.py",
        "        i = (19*g + 15) % 30",
        "        i = (19*g + 16) % 30",
        ("tests/test_easter.py::test_easter_orthodox", "tests/test_easter.py::test_easter_julian"),
        deps=("six==1.17.0",),
        pythonpath="src",
    ),
    TaskSpec(
        "webencodings",
        "webencodings==0.5.1",
        "webencodings/__init__.py",
        "    label = ascii_lower(label.strip('\\t\\n\\f\\r '))",
        "    label = ascii_lower(label.strip('\\t\\n\\f\\r'))",
        ("webencodings/tests.py::test_labels",),
    ),
    TaskSpec(
        "text-unidecode",
        "text-unidecode==1.3",
        "src/text_unidecode/__init__.py",
        "            chars.append(_replaces[codepoint-1])",
        "            chars.append(_replaces[codepoint])",
        ("test_unidecode.py::test_transliterate",),
        pythonpath="src",
    ),
    TaskSpec(
        "six",
        "six==1.17.0",
        "six.py",
        "    byte2int = operator.itemgetter(0)",
        "    byte2int = operator.itemgetter(-1)",
        ("test_six.py::test_byte2int",),
    ),
    TaskSpec(
        "boltons",
        "boltons==24.1.0",
        "boltons/iterutils.py",
        "        count = 1 + math.ceil(math.log(stop/denom, factor))",
        "        count = math.ceil(math.log(stop/denom, factor))",
        ("tests/test_iterutils.py::test_backoff_basic", "tests/test_iterutils.py::test_backoff_zero_start"),
    ),
    TaskSpec(
        "jsonpointer",
        "jsonpointer==3.0.0",
        "jsonpointer.py",
        "    return s.replace('~', '~0').replace('/', '~1')",
        "    return s.replace('/', '~1').replace('~', '~0')",
        ("tests.py::SpecificationTests::test_round_trip", "tests.py::SpecificationTests::test_str_and_repr"),
    ),
    TaskSpec(
        "parse",
        "parse==1.20.2",
        "parse.py",
        "    return float(string[:-1]) / 100.0",
        "    return float(string[:-1]) / 10.0",
        ("tests/test_parse.py::test_numbers",),
    ),
    TaskSpec(
        "sqlparse",
        "sqlparse==0.5.3",
        "sqlparse/utils.py",
        "        val = val[1:-1]",
        "        val = val[1:]",
        ("tests/test_parse.py::test_quoted_identifier", "tests/test_regressions.py::test_issue78"),
    ),
    TaskSpec(
        "tabulate",
        "tabulate==0.9.0",
        "tabulate/__init__.py",
        '    fmt = "{0:^%ds}" % width',
        '    fmt = "{0:<%ds}" % width',
        ("test/test_internal.py::test_align_column_multiline", "test/test_output.py::test_simple_multiline_2"),
    ),
    TaskSpec(
        "itsdangerous",
        "itsdangerous==2.2.0",
        "src/itsdangerous/encoding.py",
        '    return _bytes_to_int(bytestr.rjust(8, b"\\x00"))[0]',
        '    return _bytes_to_int(bytestr.ljust(8, b"\\x00"))[0]',
        (
            "tests/test_itsdangerous/test_encoding.py::test_int_bytes",
            "tests/test_itsdangerous/test_timed.py::TestTimestampSigner::test_max_age",
        ),
        deps=("freezegun==1.5.1",),
        pythonpath="src",
    ),
    TaskSpec(
        "click",
        "click==8.1.7",
        "src/click/parser.py",
        "        return opt[:2], opt[2:]",
        "        return opt[:1], opt[1:]",
        ("tests/test_basic.py::test_string_option", "tests/test_arguments.py::test_subcommand_help"),
        pythonpath="src",
    ),
    TaskSpec(
        "pyparsing",
        "pyparsing==3.2.0",
        "pyparsing/util.py",
        '    return 1 if 0 < loc < len(s) and s[loc - 1] == "\\n" else loc - s.rfind("\\n", 0, loc)',
        '    return 1 if 0 < loc < len(s) and s[loc - 1] == "\\n" else loc - s.rfind("\\n", 0, loc) - 1',
        ("tests/test_util.py::test_col",),
    ),
    TaskSpec(
        "pyasn1",
        "pyasn1==0.6.1",
        "pyasn1/type/univ.py",
        "        return self.clone(self._value + value)",
        "        return self.clone(self._value - value)",
        ("tests/type/test_univ.py::IntegerTestCase::testAdd",),
    ),
    TaskSpec(
        "decorator",
        "decorator==5.1.1",
        "src/decorator.py",
        "        na = len(args) + 1",
        "        na = len(args)",
        ("src/tests/test.py::ExtraTestCase::test_add1",),
        pythonpath="src",
    ),
)
"""The task pool (22 projects).  An iteration uses a seeded sample of it."""


@dataclass
class PreparedTask:
    """A task's files on the host (see the module docstring)."""

    spec: TaskSpec
    root: Path
    """``$WEENV_CACHE/bench-rollout/tasks/NAME-KEY``."""
    files: list[str] = field(default_factory=list)
    """The project's files (relative paths), for trajectories to read."""
    bug_line: int = 0
    """1-based line of the mutated snippet in the buggy file."""

    @property
    def tree(self) -> Path:
        """The source group's tree (``workspace/NAME`` inside)."""
        return self.root / "tree"

    @property
    def project(self) -> Path:
        return self.tree / "workspace" / self.spec.name

    @property
    def fix_patch(self) -> str:
        return (self.root / "fix.patch").read_text()

    @property
    def wrong_patch(self) -> str:
        return (self.root / "wrong.patch").read_text()


def unified_diff(path: str, before: str, after: str) -> str:
    """A ``patch -p1`` diff of one file (``a/PATH`` -> ``b/PATH``), 3 lines of context."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), fromfile=f"a/{path}", tofile=f"b/{path}"
    )
    return "".join(lines)


def mutate(text: str, spec: TaskSpec) -> str:
    """``text`` with the bug; :class:`InvalidInputError` unless the original occurs once."""
    count = text.count(spec.original)
    if count != 1:
        raise InvalidInputError(f"task {spec.name}: the snippet to mutate occurs {count} times in {spec.path}")
    return text.replace(spec.original, spec.mutated)


def prepare_task(cache: Path, spec: TaskSpec, source: Path) -> PreparedTask:
    """The buggy tree and both patches for ``spec`` from the unpacked sdist at
    ``source``; made once under ``cache/bench-rollout/tasks`` (atomic rename)."""
    root = Path(cache) / "bench-rollout" / "tasks" / f"{spec.name}-{spec.key()}"

    def fill(tmp: Path) -> None:
        project = tmp / "tree" / "workspace" / spec.name
        shutil.copytree(source, project, symlinks=True)
        target = project / spec.path
        original = target.read_text()
        buggy = mutate(original, spec)
        target.write_text(buggy)
        (tmp / "fix.patch").write_text(unified_diff(spec.path, buggy, original))
        (tmp / "wrong.patch").write_text(unified_diff(spec.path, buggy, _wrong_fix(buggy, spec)))
        files = sorted(
            str(p.relative_to(project)) for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        )
        line = buggy[: buggy.index(spec.mutated)].count("\n") + 1
        (tmp / "task.json").write_text(json.dumps({"files": files, "bug_line": line}))

    if not (root / "task.json").is_file():
        make_once(root, fill)
    info = json.loads((root / "task.json").read_text())
    return PreparedTask(spec, root, info["files"], info["bug_line"])


def _wrong_fix(buggy: str, spec: TaskSpec) -> str:
    """A plausible wrong fix: a comment above the bug, which stays."""
    indent = spec.mutated[: len(spec.mutated) - len(spec.mutated.lstrip())]
    return buggy.replace(spec.mutated, f"{indent}# checked: the bounds here look right\n{spec.mutated}")


def runtime_tree(cache: Path, log=print) -> Path:
    """The shared runtime group's tree: :data:`RUNTIME_REQUIREMENTS` installed for
    Python 3.11 into ``usr/local/lib/python3.11/dist-packages``
    (:func:`weenv.demo.deps_tree`) and Debian's ``/usr/bin/patch`` (the package's
    files, ``apt-get download`` + ``dpkg-deb -x``); cached."""
    from weenv.demo import deps_tree

    key = hashlib.sha256(json.dumps([FORMAT, RUNTIME_REQUIREMENTS, PATCH_PACKAGE]).encode()).hexdigest()[:16]
    base = Path(cache) / "bench-rollout"
    root = base / f"runtime-{key}"
    if (root / "usr" / "bin" / "patch").is_file():
        return root
    log(f"runtime group: {' '.join(RUNTIME_REQUIREMENTS)} + Debian's {PATCH_PACKAGE} ...")
    pydeps = deps_tree(Path(cache), list(RUNTIME_REQUIREMENTS))

    def fill(tmp: Path) -> None:
        run_checked(["cp", "-a", f"{pydeps}/.", str(tmp)], "copy of the pytest tree")
        debs = tmp.parent / ".debs"
        debs.mkdir(exist_ok=True)
        found = sorted(debs.glob(f"{PATCH_PACKAGE}_*.deb"))
        if not found:
            run_checked(["apt-get", "download", PATCH_PACKAGE], f"apt-get download {PATCH_PACKAGE}", cwd=debs)
            found = sorted(debs.glob(f"{PATCH_PACKAGE}_*.deb"))
        if not found:
            raise RuntimeFailedError(f"apt-get download {PATCH_PACKAGE} left no .deb in {debs}")
        unpacked = tmp.parent / f".tmp-deb-{os.getpid()}"
        shutil.rmtree(unpacked, ignore_errors=True)
        run_checked(["dpkg-deb", "-x", str(found[-1]), str(unpacked)], "dpkg-deb -x")
        (tmp / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        shutil.copy2(unpacked / "usr" / "bin" / "patch", tmp / "usr" / "bin" / "patch")
        shutil.rmtree(unpacked, ignore_errors=True)

    make_once(root, fill)
    return root


def make_once(root: Path, fill) -> None:
    """Make directory ``root`` by ``fill(tmp)`` of a fresh temporary sibling, then
    renamed into place (when another run made ``root`` meanwhile, its copy stays)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=".tmp-"))
    try:
        fill(tmp)
        os.rename(tmp, root)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def run_checked(argv: list[str], what: str, **kwargs) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if proc.returncode != 0:
        raise RuntimeFailedError(f"{what} failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-800:]}")


def reward_command(spec: TaskSpec) -> str:
    """The shell command that runs the task's failing tests (the reward)."""
    import shlex

    return f"{PYTEST} " + " ".join(shlex.quote(t) for t in spec.tests)


def patch_command(patch: str, *, reverse: bool = False) -> str:
    """A shell command applying ``patch`` (a unified diff; ``reverse``: undoing it)
    with ``patch -p1`` from the project's directory, the diff given inline as a
    here-document."""
    marker = "WEENV_PATCH_EOF"
    if marker in patch:
        raise InvalidInputError("the patch contains the here-document marker")
    flags = "-p1 --no-backup-if-mismatch" + (" -R" if reverse else "")
    return f"patch {flags} <<'{marker}'\n{patch}{marker}\n"
