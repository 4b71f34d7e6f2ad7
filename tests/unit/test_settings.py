"""The settings model (:mod:`weenv.config`): precedence environment > file >
default, one-line errors naming the variable or the file's key, ``weenv
config``, and no ``WEENV_*`` variable read anywhere else."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from weenv import config
from weenv.config import Settings, load, settings
from weenv.errors import InvalidInputError

SRC = Path(__file__).resolve().parents[2] / "src" / "weenv"


def _file(tmp_path: Path, text: str) -> dict[str, str]:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return {"WEENV_CONFIG": str(path)}


def test_environment_over_file_over_default(tmp_path):
    environ = _file(tmp_path, '[pool]\nsize = 4\n[network]\ncidr = "10.210.0.0/16"\nenabled = false\n')
    environ["WEENV_POOL_SIZE"] = "7"
    environ["WEENV_NETWORK"] = ""  # empty: unset, so the file's value holds
    loaded = load(environ)
    s = loaded.settings
    assert s.pool.size == 7 and loaded.origin("pool", "size") == "env"
    assert str(s.network.cidr) == "10.210.0.0/16" and loaded.origin("network", "cidr") == "file"
    assert s.network.enabled is False and loaded.origin("network", "enabled") == "file"
    assert s.runtime.max_fork == 100 and loaded.origin("runtime", "max_fork") == "default"
    assert s.runtime.userns is True and loaded.origin("runtime", "userns") == "default"  # every environment
    assert load({"WEENV_USERNS": "off"}).settings.runtime.userns is False
    assert load({"WEENV_HOME": str(tmp_path / "none")}).path == tmp_path / "none" / "config.toml"


@pytest.mark.parametrize(
    "var, value",
    [
        ("WEENV_POOL_SIZE", "-1"),
        ("WEENV_POOL_SIZE", "two"),
        ("WEENV_RUNTIME", "docker"),
        ("WEENV_USERNS", "maybe"),
        ("WEENV_NET_CIDR", "10.0.0.1/16"),
        ("WEENV_NET_CIDR", "10.0.0.0/31"),
        ("WEENV_DISK_BYTES", "64X"),
        ("WEENV_RELAY_IDLE_S", "nan"),
        ("WEENV_STORE_LEASE_S", "0"),
        ("WEENV_DNS_UPSTREAM", "10.0.0.1:70000"),
        ("WEENV_ADMISSION", "PEAK"),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(var, value):
    with pytest.raises(InvalidInputError) as exc:
        load({var: value})
    msg = str(exc.value)
    assert msg.startswith(f"{var}={value!r}: want "), msg
    assert "\n" not in msg and "pydantic" not in msg, msg


@pytest.mark.parametrize(
    "text, words",
    [
        ("[pool]\nsize = -2\n", ("[pool] size = -2", "want an integer >= 0")),
        ("[pool]\nsise = 2\n", ("unknown setting [pool] sise", "size")),
        ("[pools]\nsize = 2\n", ("unknown group [pools]", "pool")),
        ("pool = 2\n", ("pool must be a table",)),
        ("[pool\nsize = 2\n", ("not valid TOML",)),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_key(tmp_path, text, words):
    with pytest.raises(InvalidInputError) as exc:
        load(_file(tmp_path, text))
    msg = str(exc.value)
    assert str(tmp_path / "node.toml") in msg and "\n" not in msg, msg
    assert all(w in msg for w in words), msg


def test_a_named_file_must_exist(tmp_path):
    with pytest.raises(InvalidInputError, match="WEENV_CONFIG=.*no such settings file"):
        load({"WEENV_CONFIG": str(tmp_path / "missing.toml")})


def test_settings_follow_the_environment_between_calls(monkeypatch, tmp_path):
    """Modules call :func:`settings` per use: a variable set (or a file changed)
    after a first read is seen at the next one."""
    monkeypatch.setenv("WEENV_CONFIG", _file(tmp_path, "[runtime]\nmax_fork = 5\n")["WEENV_CONFIG"])
    monkeypatch.setenv("WEENV_POOL_SIZE", "2")
    assert settings().pool.size == 2 and settings().runtime.max_fork == 5
    monkeypatch.setenv("WEENV_POOL_SIZE", "3")
    (tmp_path / "node.toml").write_text("[runtime]\nmax_fork = 6\n# longer\n")
    assert settings().pool.size == 3 and settings().runtime.max_fork == 6
    assert Settings().pool.size == 3  # pydantic-settings' own construction reads the same sources


def test_weenv_config_prints_each_setting_and_its_source(monkeypatch, tmp_path):
    from weenv.cli import app

    monkeypatch.setenv("WEENV_CONFIG", _file(tmp_path, "[pool]\nsize = 4\n")["WEENV_CONFIG"])
    monkeypatch.setenv("WEENV_MAX_FORK", "9")
    monkeypatch.setenv("WEENV_API_KEY", "secret-key")
    result = CliRunner().invoke(app, ["config", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    rows = {r["variable"]: r for r in doc["settings"]}
    assert len(rows) == len(config.fields())
    assert (rows["WEENV_POOL_SIZE"]["value"], rows["WEENV_POOL_SIZE"]["source"]) == (4, "file")
    assert (rows["WEENV_MAX_FORK"]["value"], rows["WEENV_MAX_FORK"]["source"]) == (9, "env")
    assert (rows["WEENV_RUNTIME"]["value"], rows["WEENV_RUNTIME"]["source"]) == ("auto", "default")
    assert "secret-key" not in result.output
    table = CliRunner().invoke(app, ["config"])
    assert table.exit_code == 0 and "WEENV_MAX_FORK" in table.output and "env" in table.output
    monkeypatch.setenv("WEENV_MAX_FORK", "0")
    bad = CliRunner().invoke(app, ["config"])  # weenv.cli.main prints it as one "weenv: error:" line
    assert isinstance(bad.exception, InvalidInputError)
    assert str(bad.exception) == "WEENV_MAX_FORK='0': want a positive integer"


def _environ_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, variable)`` of every read of a ``WEENV_*`` variable in ``tree``:
    ``os.environ.get``/``os.getenv``/``os.environ[...]``/``in os.environ`` of a
    string, of a module constant holding one, or of a loop variable over a literal naming one."""
    names: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names.setdefault(t.id, set()).add(str(node.value.value))
        if isinstance(node, ast.For | ast.comprehension):
            consts = {str(c.value) for c in ast.walk(node.iter) if isinstance(c, ast.Constant)}
            for t in ast.walk(node.target):
                if isinstance(t, ast.Name):
                    names.setdefault(t.id, set()).update(consts)

    def weenv(expr: ast.AST) -> list[str]:
        if isinstance(expr, ast.Constant):
            values = {str(expr.value)}
        elif isinstance(expr, ast.Name):
            values = names.get(expr.id, set())
        else:
            values = set()
        return [v for v in values if v.startswith("WEENV_")]

    def is_environ(expr: ast.AST) -> bool:
        return (
            isinstance(expr, ast.Attribute)
            and expr.attr == "environ"
            or isinstance(expr, ast.Name)
            and expr.id == "environ"
        )

    out = []
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and (f.attr == "getenv" or f.attr in ("get", "pop") and is_environ(f.value))
                or isinstance(f, ast.Name)
                and f.id == "getenv"
            ):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            arg = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            arg = node.left
        if arg is not None:
            out += [(node.lineno, v) for v in weenv(arg)]
    return out


def test_the_scan_finds_each_kind_of_read():
    tree = ast.parse(
        'import os\nV = "WEENV_B"\nos.environ.get("WEENV_A")\nos.getenv(V)\nos.environ["WEENV_C"]\n'
        '"WEENV_D" in os.environ\nfor n in ("WEENV_E",):\n    os.environ.get(n)\n'
        'dict(os.environ, WEENV_F="x")\nos.environ.get("HOME")\n'
    )
    assert sorted(v for _, v in _environ_reads(tree)) == ["WEENV_A", "WEENV_B", "WEENV_C", "WEENV_D", "WEENV_E"]


def test_no_module_but_config_reads_a_weenv_variable():
    """Settings are read through :mod:`weenv.config` only, so each is typed,
    documented and shown by ``weenv config``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "config.py":
            continue
        for line, var in _environ_reads(ast.parse(path.read_text(), filename=str(path))):
            found.append(f"{path.relative_to(SRC)}:{line}: {var}")
    assert not found, "read these through weenv.config.settings(): " + "; ".join(found)


def test_module_defaults_are_the_models():
    """Constants the modules keep for their callers and docs agree with the model's defaults."""
    from weenv.build import stepbuild
    from weenv.node.provision.models import ProvisionConfig
    from weenv.node.runtime import network, runtime
    from weenv.node.state import fork, pool
    from weenv.server import e2b
    from weenv.server.e2b import ports, uploads
    from weenv.store import lease

    defaults = {f"{group}.{key}": info.default for group, key, info in config.fields()}
    assert defaults["pool.size"] == pool.DEFAULT_SIZE
    assert defaults["runtime.name"] == runtime.DEFAULT_RUNTIME
    assert set(config.RuntimeSettings.model_fields["name"].annotation.__args__) == set(runtime.RUNTIMES)
    assert defaults["runtime.max_fork"] == fork.DEFAULT_MAX_FORK
    assert str(defaults["network.cidr"]) == network.DEFAULT_CIDR
    assert defaults["build.e2b_registry"] == stepbuild.DEFAULT_REGISTRY
    assert defaults["server.e2b_upload_ttl_s"] == uploads.UPLOAD_TTL_S
    assert defaults["server.e2b_uploads_max_bytes"] == uploads.UPLOADS_MAX_BYTES
    assert defaults["server.e2b_ready_timeout_s"] == e2b.READY_TIMEOUT_S
    assert defaults["server.relay_idle_s"] == ports.RELAY_IDLE_S
    assert defaults["store.lease_s"] == lease.DEFAULT_LEASE_S
    assert defaults["store.gc_grace_s"] == lease.DEFAULT_GC_GRACE_S
    provision = ProvisionConfig()
    for key in config.ProvisionSettings.model_fields:
        assert getattr(provision, key) == defaults[f"provision.{key}"], key
