"""``flashnext bench``'s input checks: one line, a non-zero exit, nothing written."""

import json

import pytest
from click.testing import CliRunner

from flashnext.tools.cli import main
from support.chat_server import free_port


def _run(*args):
    return CliRunner().invoke(main, ["bench", *args])


def _one_error_line(done, code=1):
    assert done.exit_code == code, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.output
    return lines[0]



def test_an_unreachable_server_is_one_line_and_writes_nothing(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    line = _one_error_line(_run(url, "--out", str(tmp_path / "run"), "--no-progress"))
    assert "cannot reach" in line
    assert not (tmp_path / "run").exists()
    line = _one_error_line(_run(url, "--model", "m", "--out", str(tmp_path / "run"), "--no-progress"))
    assert "connect" in line and not (tmp_path / "run").exists()


def test_force_never_replaces_a_directory_flashnext_did_not_make(tmp_path):
    mine = tmp_path / "results"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    line = _one_error_line(_run(f"http://127.0.0.1:{free_port()}", "--out", str(mine), "--force"))
    assert "flashnext" in line
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("args, words, code", [
    (["--extra-body", "{nope"], "--extra-body is not JSON", 1),
    (["--extra-body", "[1]"], "must be a JSON object", 1),
    # Options that cannot go together are a usage error, as click's own are.
    (["--against", "http://127.0.0.1:1", "--baseline", "x.json"], "not both", 2),
    (["--against-model", "m"], "--against-model needs --against", 2),
])
def test_bad_options_are_one_line(tmp_path, args, words, code):
    line = _one_error_line(_run("http://127.0.0.1:1", "--out", str(tmp_path / "o"), *args), code)
    assert words in line
    assert not (tmp_path / "o").exists()


def test_a_baseline_that_is_not_a_report_is_one_line(tmp_path):
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"schema_version": 2, "surprise": True}))
    line = _one_error_line(_run("http://127.0.0.1:1", "--out", str(tmp_path / "o"), "--baseline", str(bad)))
    assert "not a flashnext bench report" in line
    missing = _one_error_line(_run("http://127.0.0.1:1", "--out", str(tmp_path / "o"), "--baseline",
                                   str(tmp_path / "none.json")))
    assert "no such report" in missing


@pytest.mark.parametrize("args", [["--phases", "latency,warp"], ["--prompt-tokens", "0"],
                                  ["--needle-depths", "1.5"], ["--concurrency", "a,b"]])
def test_bad_values_are_usage_errors(tmp_path, args):
    done = _run("http://127.0.0.1:1", "--out", str(tmp_path / "o"), *args)
    assert done.exit_code == 2, done.output
    assert not (tmp_path / "o").exists()


def test_help_shows_every_phase():
    out = _run("--help").output
    for phase in ("latency", "decode", "needle", "structured", "--against", "--baseline", "--json"):
        assert phase in out


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:8000/v1"])
def test_a_url_without_a_scheme_is_told_the_one_it_needs(tmp_path, url):
    line = _one_error_line(_run(url, "--out", str(tmp_path / "o")))
    assert f"http://{url}" in line
    assert not (tmp_path / "o").exists()
