"""``weenv import`` has one path (layers streamed into the image writer): the
old ``--extract`` is gone and fails as any unknown option does, before any
source is opened."""

from __future__ import annotations

from typer.testing import CliRunner

from weenv.cli import app


def test_extract_is_an_unknown_option(tmp_path):
    result = CliRunner().invoke(app, ["import", str(tmp_path / "no-such-layout"), "--extract"])
    assert result.exit_code == 2, result.output
    assert "No such option" in result.output and "--extract" in result.output


def test_an_unknown_option_fails_the_same_way(tmp_path):
    result = CliRunner().invoke(app, ["import", str(tmp_path / "no-such-layout"), "--frobnicate"])
    assert result.exit_code == 2, result.output
    assert "No such option" in result.output
