"""The phase registry is the one list of phases: the settings, the CLI, the plan, the runner and the
report agree with it, and a phase registered from outside is run, counted and offered like the others.

Runs the real ``Bench`` and the real ``flashnext bench`` command against the stand-in server
(tests/support/fault_server.py); the request counts come from what the server received.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from collections import Counter

import click
import pytest
from click.testing import CliRunner

from flashnext.serving.bench import Bench, Settings
from flashnext.serving.bench.phases import PHASES, setting_options
from flashnext.serving.bench.phases.base import PhaseDefaults
from flashnext.serving.bench.phases.structured import FORMATS
from flashnext.serving.bench.report import EndpointReport
from flashnext.tools import bench as bench_tool
from support import ROOT
from support.fault_server import FaultServer

# EndpointReport's fields that no one phase fills: the probe's, the failures', and what latency and
# decode pool (ITL samples) or decode keeps for the A/B (greedy answers).
SHARED_FIELDS = {"label", "url", "model", "capabilities", "scale", "itl_samples_s", "greedy_answers", "requests",
                 "errors", "failures", "error_samples", "server_state"}
# The run's own options, which fill no setting.
RUN_ONLY = {"url", "against", "baseline", "allow_different_settings", "model", "against_model", "out", "force",
            "fail_on_errors", "progress", "as_json"}


def test_every_setting_is_filled_by_exactly_one_option_and_the_cli_offers_each():
    options = setting_options()
    settings = Counter(o.setting for o in options)
    assert set(settings) == set(Settings.model_fields), "a Settings field without its option, or the reverse"
    assert max(settings.values()) == 1, settings
    assert len({o.flag for o in options}) == len(options)
    params = {p.name: p for p in bench_tool.main.params}
    assert set(params) == set(settings) | RUN_ONLY
    for o in options:
        assert o.flag in params[o.setting].opts, (o.flag, params[o.setting].opts)


def test_the_cli_defaults_are_a_valid_run():
    ctx = bench_tool.main.make_context("bench", ["http://127.0.0.1:1", "--out", "o"])
    given = {o.setting: ctx.params[o.setting] for o in setting_options()}
    settings = Settings(**(given | {"phases": given["phases"].split(","), "extra_body": json.loads(given["extra_body"])}))
    # The phases that take hours at their defaults (seed 004's sessions, 45 images of 2 MP) are asked for by name.
    assert settings.phases == [name for name, p in PHASES.items() if p.by_default]
    assert {"multiturn", "images"} <= set(PHASES) - set(settings.phases)


def test_the_structured_formats_have_one_spelling():
    assert typing.get_args(Settings.model_fields["structured_format"].annotation) == FORMATS
    structured = next(o for o in PHASES["structured"].options if o.setting == "structured_format")
    assert structured.kind.choices == FORMATS


def test_every_phase_fills_its_own_report_field_and_the_rest_are_shared():
    fields = [p.report_field for p in PHASES.values() if p.report_field is not None]
    assert len(set(fields)) == len(fields)
    assert set(fields) | SHARED_FIELDS == set(EndpointReport.model_fields)
    assert not set(fields) & SHARED_FIELDS


def _settings(phases: list[str]) -> Settings:
    return Settings(prompt_tokens=[64, 96], concurrency=[1, 2], decode_concurrency=[1, 3], decode_tokens=8,
                    ttft_max_tokens=4, warmup=1, repeats=2, needle_tokens=[256], needle_depths=[0.2, 0.5, 0.8],
                    needle_concurrency=2, needle_max_tokens=8, structured_requests=5, structured_concurrency=2,
                    structured_max_tokens=64, structured_format="json_schema", top_logprobs=2, seed=0,
                    request_timeout_s=20, stall_timeout_s=5, phases=phases, extra_body={},
                    # The stand-in answers 8 tokens: a request for fewer gets "absurd" usage back, a failure,
                    # and a multiturn session ends at its first failed turn.
                    multiturn_sessions=[1, 2], multiturn_turns=3, multiturn_first_tokens=64, multiturn_turn_tokens=16,
                    multiturn_output_tokens=8, images=3, image_size=[32, 24], image_concurrency=2,
                    image_prefill_tokens=64, image_max_tokens=8)


@pytest.mark.parametrize("phase", list(PHASES))
def test_each_phase_sends_the_requests_it_plans(phase):
    with FaultServer(schedule=("ok",)) as a, FaultServer(schedule=("ok",)) as b:
        bench = Bench(_settings([phase]), [a.url, b.url], models=["fault-model", "fault-model"])
        progressed = []
        bench.progress = progressed.append
        planned = bench.planned_requests()
        report = bench.run()
        probes = 6  # the probe's requests (tokens <= 2), not counted
        # /metrics is asked too (once: the stand-in has none); only chat requests are the phase's.
        sent = [sum(t.endswith("/chat/completions") for _, t, _ in s.requests) - probes for s in (a, b)]
    assert planned > 0 and sum(progressed) == planned
    assert sent == [e.requests for e in report.endpoints] == [planned // 2] * 2


class Toy(PhaseDefaults):
    """A phase from outside the package: one request per endpoint, noted in the report."""

    name = "toy"
    help = "one short request per endpoint\n(a second line of help)"

    def planned_requests(self, settings) -> int:
        return 1

    async def run(self, bench) -> None:
        from flashnext.serving.bench import workloads

        for ep in bench.endpoints:
            [done] = await bench.send(ep, self.name, [bench.body(ep, workloads.messages("Say hi."), 16)])
            bench.notes.append(f"{ep.label}: toy answered {done.ok}")

    def summary_lines(self, e) -> list[str]:
        return [f"  toy: {e.label}"]


def test_a_registered_phase_is_run_counted_and_offered(monkeypatch, tmp_path):
    monkeypatch.setitem(PHASES, "toy", Toy())
    command = bench_tool.command()
    help_text = CliRunner().invoke(command, ["--help"]).output
    assert "  toy         one short request per endpoint\n" in help_text
    assert "latency,decode,needle,structured,toy" in help_text  # --phases' default
    refused = CliRunner().invoke(command, ["http://127.0.0.1:1", "--out", str(tmp_path / "x"), "--phases", "warp"])
    assert refused.exit_code == 2 and "toy" in refused.output
    with FaultServer(schedule=("ok",)) as server:
        assert Bench(_settings(["toy", "decode"]), [server.url]).planned_requests() == 1 + 3 * 4
        done = CliRunner().invoke(command, [server.url, "--out", str(tmp_path / "run"), "--phases", "toy",
                                            "--no-progress"])
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["settings"]["phases"] == ["toy"] and report["endpoints"][0]["requests"] == 1
    assert "this run: toy answered True" in report["notes"]
    assert "  toy: this run" in done.output.splitlines()


def test_the_command_loads_and_says_what_to_install_without_the_bench_extra(tmp_path):
    # The extra's modules cannot be imported, and importlib finds none of them (the command's check).
    script = (
        "import importlib.util, sys\n"
        "EXTRA = ('httpx', 'jsonschema', 'matplotlib')\n"
        "class NoExtra:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in EXTRA:\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, NoExtra())\n"
        "found = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name in EXTRA else found(name, *a)\n"
        "from click.testing import CliRunner\n"
        "from flashnext.tools.cli import main\n"
        "print(CliRunner().invoke(main, ['bench', '--help']).output)\n"
        "done = CliRunner().invoke(main, ['bench', 'http://127.0.0.1:9', '--out', 'b'])\n"
        "print(done.exit_code, done.output)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "tests")}, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in PHASES:
        assert f"  {name} " in out.stdout
    assert "1 Error: flashnext bench needs httpx, matplotlib, jsonschema" in out.stdout, out.stdout


def test_the_phases_options_are_click_options():
    for o in setting_options():
        assert isinstance(bench_tool._click_option(o)(lambda: None).__click_params__[0], click.Option)


def test_the_docs_list_the_registrys_phases_and_options():
    doc = (ROOT / "docs" / "bench.md").read_text()
    section = doc[doc.index("## Phases (`--phases`)"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines()
            if line.startswith("| `")]
    assert rows == list(PHASES)
    missing = [o.flag for o in setting_options() if o.flag not in doc]
    assert not missing, f"docs/bench.md does not name {missing}"
