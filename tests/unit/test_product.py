"""The product is what users install: ``weenv``'s wheel holds no benchmarks and no
host services and does not need matplotlib; ``weenv bench`` is there when the
benchmarks' package (``benchmarks/``, ``weenv-bench``) is importable and says how
to install it when not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


HIDE = """\
import sys


class Hide:
    \"\"\"Not installed, as far as ``import`` can tell (even if a venv holds them).\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Hide())
"""


def weenv(*args: str, hide: tuple[str, ...] = (), home: Path | None = None) -> subprocess.CompletedProcess:
    """``weenv ARGS`` from this checkout (its ``src/`` and ``benchmarks/``) as if
    the top-level packages in ``hide`` were not installed."""
    code = f"HIDDEN = {hide!r}\n{HIDE}\nfrom weenv.cli import main\nsys.argv = ['weenv', *{args!r}]\nmain()\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]), COLUMNS="200")
    if home is not None:
        env["WEENV_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
        cwd="/",
    )


def test_the_wheel_holds_the_product_alone(tmp_path):
    """Built from a copy of the checkout: no ``weenv/bench`` or ``weenv/services`` in
    the wheel, matplotlib only under the ``plot`` and ``bench`` extras, and ``bench``
    naming the checkout's ``benchmarks/`` (so ``pip install '.[bench]'`` works)."""
    src = tmp_path / "weenv"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("src", "benchmarks"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "out"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = out.glob("weenv-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(z.read(meta_name).decode())
    assert "weenv/cli/__init__.py" in names and "weenv/node/runtime/agent/agent.c" in names
    assert {"weenv/server/ui/templates/base.html", "weenv/server/ui/static/ui.js"} <= set(names)  # the dashboard's
    assert not [n for n in names if n.startswith(("weenv/bench/", "weenv/services/", "weenv_bench/"))]
    requires = meta.get_all("Requires-Dist")
    plain = [r for r in requires if "extra ==" not in r]
    assert plain and not [r for r in plain if "matplotlib" in r or "weenv-bench" in r], plain
    bench = [r for r in requires if 'extra == "bench"' in r]
    assert any(r.startswith("matplotlib") for r in bench), bench
    assert any(r.startswith(f"weenv-bench @ {(src / 'benchmarks').as_uri()}") for r in bench), bench
    assert any(r.startswith("matplotlib") for r in requires if 'extra == "plot"' in r), requires


def test_the_cli_does_not_import_matplotlib_or_the_benchmarks():
    """The product's modules load neither matplotlib nor a benchmark (only the
    ``weenv bench`` commands' definitions, :mod:`weenv_bench.cli`)."""
    code = (
        "import sys, weenv.cli, weenv.demo, weenv.server.daemon, weenv.sdk\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'weenv_bench')))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "['weenv_bench', 'weenv_bench.cli']", r.stdout + r.stderr


def test_bench_commands_come_with_the_benchmarks():
    r = weenv("bench", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("update", "start", "provision", "rollout"):
        assert command in r.stdout
    r = weenv("bench", "start", "--help")
    assert r.returncode == 0 and "--quick" in r.stdout, r.stderr


def test_bench_without_the_benchmarks_is_one_line():
    for args in (("bench",), ("bench", "--help"), ("bench", "start", "--quick")):
        r = weenv(*args, hide=("weenv_bench",))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip() == (
            "weenv: error: the benchmarks are not installed: pip install 'weenv[bench]' "
            "(from a checkout: pip install '.[bench]')"
        ), r.stderr
    r = weenv("--help", hide=("weenv_bench",))
    assert r.returncode == 0 and "bench" in r.stdout and "group" in r.stdout


def test_stats_plot_without_matplotlib_is_one_line_before_asking_the_daemon(tmp_path):
    """No daemon runs under ``tmp_path``: the missing matplotlib is said first."""
    r = weenv("stats", "--plot", str(tmp_path / "x.png"), hide=("matplotlib",), home=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "weenv: error: --plot needs matplotlib: pip install 'weenv[plot]'", r.stderr
