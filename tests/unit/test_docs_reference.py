"""The documentation's reference pages (``scripts/gen_docs_reference.py``, run by
the mkdocs hook at every build) name everything the code has: every ``weenv``
command and option, every HTTP route the server's modules declare, every
``WEENV_*`` variable the code names, every metric a node exposes, every error
kind.  Each check reads the code by a way of its own (the typer app, the route
decorators' text, a regex over the sources, a rendered registry), not by the
generator's."""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "weenv"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_docs_reference", ROOT / "scripts" / "gen_docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return _generator().pages()


def _section(page: str, heading: str) -> str:
    """The text of ``page`` under the heading line ``heading``, up to the next heading of its level."""
    assert heading + "\n" in page, f"{heading} missing from the page"
    start = page.index(heading + "\n")
    rest = page[start + len(heading) + 1 :]
    end = rest.find("\n## ")
    return rest if end < 0 else rest[:end]


def test_every_command_and_option(pages):
    import typer.main

    from weenv.cli import app

    page = pages["reference/cli.md"]

    def walk(path: str, command) -> None:
        if path != "weenv":
            section = _section(page, f"## `{path}`")
            for param in command.params:
                if param.name == "help":
                    continue
                names = param.opts if param.opts[0].startswith("-") else [(param.metavar or param.name).upper()]
                for name in names:
                    assert f"`{name}`" in section, f"{path}: {name} missing from reference/cli.md"
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(f"{path} {name}", sub)

    walk("weenv", typer.main.get_command(app))


ROUTE_RE = re.compile(r"@\w+\.(get|post|put|delete|patch)\(\s*\"([^\"]+)\"")


def test_every_route_the_server_declares(pages):
    rows = re.findall(r"^\| (GET|POST|PUT|DELETE|PATCH) \| `([^`]+)` \|", pages["reference/http.md"], re.M)
    assert len(rows) > 50
    declared = [
        (m.upper(), p, path.relative_to(ROOT))
        for path in sorted((SRC / "server").rglob("*.py"))
        for m, p in ROUTE_RE.findall(path.read_text())
    ]
    assert len(declared) > 50
    for method, route, where in declared:
        assert any(m == method and p.endswith(route) for m, p in rows), (
            f"{method} {route} ({where}) missing from reference/http.md"
        )


def test_envd_routes(pages):
    page = pages["reference/http.md"]
    for route in ("/e2b/envd/health", "/e2b/envd/files", "process.Process/Start", "filesystem.Filesystem/WatchDir"):
        assert route in page


def test_every_setting_the_code_names(pages):
    page = pages["reference/settings.md"]
    rows = set(re.findall(r"^\| `(WEENV_[A-Z0-9_]+)` \|", page, re.M))
    named = {
        name for path in SRC.rglob("*.py") for name in re.findall(r"\bWEENV_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert len(named) >= 30
    assert named <= rows, f"missing from reference/settings.md: {sorted(named - rows)}"
    assert {"WEENV_NEMO_VENV", "WEENV_HARBOR_VENV"} <= rows  # scripts/setup.sh's
    home = next(line for line in page.splitlines() if line.startswith("| `WEENV_HOME`"))
    assert "/var/lib/weenv" in home and "| `home` |" in home


def test_every_field_of_the_settings_model(pages):
    """Each field of the settings model has a row under its group's table, with its file key."""
    from weenv.config import Settings

    page = pages["reference/settings.md"]
    for group, info in Settings.model_fields.items():
        table = _section(page, f"## `[{group}]`")
        for key, field in info.annotation.model_fields.items():
            env = field.json_schema_extra["env"]
            assert f"| `{env}` | `{key}` |" in table, (group, key)


def test_every_metric_a_node_exposes(pages):
    from weenv.config import Paths
    from weenv.node.node import Node
    from weenv.server.metrics import Metrics
    from weenv.store.file import FileStore

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        node = Node(Paths(home=root / "home", cache=root / "cache", store_url=""), store=FileStore(root / "store"))
        text = Metrics(node).render().decode()
    exposed = {name for name in re.findall(r"^# TYPE (\S+) ", text, re.M) if not name.endswith("_created")}
    cluster = set(re.findall(r"MetricFamily\(\s*\"(weenv_\w+)\"", (SRC / "cluster" / "stats.py").read_text()))
    rows = set(re.findall(r"^\| `(weenv_\w+)` \|", pages["reference/metrics.md"], re.M))
    assert len(exposed) >= 10 and cluster
    assert exposed | cluster <= rows, f"missing from reference/metrics.md: {sorted((exposed | cluster) - rows)}"


def test_every_error_kind_with_its_status(pages):
    from weenv import errors
    from weenv.server.kit.errors import STATUS

    page = pages["reference/errors.md"]
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.WeenvError):
            row = next((line for line in page.splitlines() if line.startswith(f"| `{cls.kind}` |")), None)
            assert row is not None, f"{cls.kind} missing from reference/errors.md"
            assert f"| {STATUS.get(cls.kind, 500)} |" in row


def test_the_site_builds_the_pages():
    """mkdocs.yml runs the hook and lists every generated page in its nav."""
    config = (ROOT / "mkdocs.yml").read_text()
    assert "docs/hooks/reference.py" in config
    for uri in _generator().PAGES:
        assert f": {uri}" in config, f"{uri} is not in mkdocs.yml's nav"
        assert not (ROOT / "docs" / uri).exists(), f"docs/{uri} is generated at build: do not commit it"
