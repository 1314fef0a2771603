"""Issue 43: one Deployment flows through serving, resolved once. A `serve` reads each config.json
and each index once, loads its profile once and plans once, however many stages (the PLE-table
rule, the compose file, the preflight, the plan line, the view the native engine makes) ask; an
overlay's config.json and index included, the preflight's hashing of them apart (what it checks).
The served model is the overlays stacked over the snapshot by the rule `overlay apply` writes a view
with; a read that failed is said again without reading again."""

import builtins
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.quant.overlays import view
from flashnext.serving import profiles
from flashnext.serving.capacity import ledger, qwen4_exp
from flashnext.serving.deployment import Deployment, resolve_deployment
from flashnext.tools.cli import main as cli

READ = ("config.json", "model.safetensors.index.json")


@pytest.fixture
def reads(monkeypatch):
    """What a command reads while it runs: the opens for reading of each config.json and safetensors
    index (by ``open`` or ``os.open``, whichever reader opens it; those of the overlay check's
    hashing counted apart, as ``("hashed", path)``), the profile files read and the plans computed."""
    counts: Counter = Counter()
    real_open, real_os_open = builtins.open, os.open
    hashing: list[bool] = []

    def note(path) -> None:
        if not isinstance(path, int) and os.path.basename(os.fsdecode(path)) in READ:
            where = os.path.abspath(os.fsdecode(path))
            if where.startswith("/proc/self/fd/"):  # through a folder a writer holds open: the folder's path
                where = os.path.join(os.path.realpath(os.path.dirname(where)), os.path.basename(where))
            counts[("hashed", where) if hashing else where] += 1

    def hashed(fn):
        def wrapper(*a, **kw):
            hashing.append(True)
            try:
                return fn(*a, **kw)
            finally:
                hashing.pop()
        return wrapper

    def open_(file, *a, **kw):
        if not set(a[0] if a else kw.get("mode", "r")) & set("wax+"):  # a read, not a write
            note(file)
        return real_open(file, *a, **kw)

    def os_open(path, *a, **kw):
        if not (a[0] if a else kw["flags"]) & (os.O_WRONLY | os.O_RDWR):
            note(path)
        return real_os_open(path, *a, **kw)

    def counted(key, fn):
        def wrapper(*a, **kw):
            counts[key] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(profiles, "_read_profile", counted("profile loads", profiles._read_profile))
    monkeypatch.setattr(qwen4_exp, "plan", counted("plans", qwen4_exp.plan))
    monkeypatch.setattr(view, "sha256_file", hashed(view.sha256_file))
    return counts


def config_of(folder: Path) -> str:
    return os.path.abspath(folder / "config.json")


def index_of(folder: Path) -> str:
    return os.path.abspath(folder / "model.safetensors.index.json")


@pytest.fixture
def table(tmp_path) -> Path:
    path = tmp_path / "ple.bin"  # serve checks that it is there; the preflight finds it is no table
    path.write_bytes(b"")
    return path


def serve(*argv: str):
    result = CliRunner().invoke(cli, ["serve", "--profile", "3x3090", *argv])
    return result


def test_serve_dry_run_reads_config_once_and_loads_the_profile_once(reads, demo_snapshot, table):
    result = serve("--model", str(demo_snapshot), "--ple-table", str(table), "--dry-run")
    assert result.exit_code == 0, result.output
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1}  # --dry-run prints no plan: none made


def test_serve_dry_run_with_an_overlay_reads_the_served_config_only(reads, demo_snapshot, demo_overlay, table):
    result = serve("--model", str(demo_snapshot), "--overlay", str(demo_overlay), "--ple-table", str(table),
                   "--dry-run")
    assert result.exit_code == 0, result.output
    assert reads == {config_of(demo_overlay): 1, "profile loads": 1}


def test_serve_plans_once_and_the_preflight_reads_nothing_again(reads, demo_snapshot, table, monkeypatch):
    """`serve` to its start: the preflight's verdict (a NO-GO on a machine without the profile's
    GPUs), and on a GO the plan line and the start, stood in for here."""
    from flashnext.tools import serve as serve_command

    monkeypatch.setattr(serve_command, "exec_native", lambda cmd, env: None)
    result = serve("--model", str(demo_snapshot), "--ple-table", str(table), "--engine", "native")
    assert "host-ram" in result.output, result.output
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}, result.output


def test_doctor_reads_config_once(reads, demo_snapshot, demo_table):
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--ple-table", str(demo_table), "--engine", "native"])
    assert "ple-table" in result.output, result.output
    # the table is checked against the snapshot: its index, read once too
    assert reads == {config_of(demo_snapshot): 1, index_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}, \
        result.output


def test_plan_reads_config_once(reads, demo_snapshot):
    result = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--model", str(demo_snapshot), "--json"])
    assert result.exit_code == 0, result.output
    # the weights column sizes the snapshot's tensors: its index, read once too
    assert reads == {config_of(demo_snapshot): 1, index_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}


def test_the_count_sees_a_second_reader(reads, demo_snapshot, table, monkeypatch):
    """The counts above would catch a stage that read config.json again, by any reader."""
    from flashnext.serving.capacity.model import load_text_config
    from flashnext.tools import serve as serve_command

    def require_ple_table_and_read_again(deployment):
        load_text_config(deployment.model)  # a stage reading the model itself, not through the Deployment
        return require_ple_table(deployment)

    require_ple_table = serve_command.require_ple_table
    monkeypatch.setattr(serve_command, "require_ple_table", require_ple_table_and_read_again)
    result = serve("--model", str(demo_snapshot), "--ple-table", str(table), "--dry-run")
    assert result.exit_code == 0, result.output
    assert reads[config_of(demo_snapshot)] == 2


def test_a_deployment_reads_and_plans_once_however_often_asked(reads, demo_snapshot):
    deployment = resolve_deployment("3x3090", demo_snapshot)
    for _ in range(3):
        deployment.plan, deployment.ple_format, deployment.served_config, deployment.shape
    assert reads == {config_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}


def test_a_deployment_without_a_model_plans_the_pinned_checkpoint():
    from flashnext.serving import capacity
    from flashnext.serving.profiles import load_profile

    profile = load_profile("3x3090")
    deployment = Deployment(profile)
    assert deployment.served_config is None and deployment.ple_format is None
    assert deployment.plan.to_json() == capacity.plan_profile(profile).to_json()


def test_the_host_terms_size_the_pinned_table_from_the_deployments_snapshot(reads, demo_snapshot, tmp_path):
    """Without --ple-table the table is pinned, sized from the snapshot's shards: the snapshot the
    Deployment opened with the config.json it read, not a second opening."""
    from flashnext.serving import preflight as pf

    deployment = resolve_deployment("3x3090", demo_snapshot)
    finding = pf.check_host_ram(deployment, memory_max=tmp_path / "absent")
    assert finding.terms and "PLE table" in finding.terms, finding
    assert reads == {config_of(demo_snapshot): 1, index_of(demo_snapshot): 1, "profile loads": 1, "plans": 1}


# --- overlays: the served model, read once -----------------------------------------------------------

def hashed_by_the_overlay_check(base: Path, overlay: Path) -> dict:
    """What the preflight's overlay check hashes: the overlay's config.json and index against its
    manifest, and the base's that it replaces against the hashes the manifest pins."""
    return {("hashed", path(folder)): 1 for folder in (base, overlay) for path in (config_of, index_of)}


def test_doctor_with_an_overlay_reads_each_file_once(reads, demo_snapshot, demo_overlay):
    """Without --ple-table the table is pinned and sized from the served model (the overlay over the
    snapshot, merged in memory): the overlay's config.json and index are read once, the snapshot's
    once, and the overlay check hashes each once more (what it checks, not a read of the model)."""
    result = CliRunner().invoke(cli, ["doctor", "--profile", "3x3090", "--model", str(demo_snapshot),
                                      "--overlay", str(demo_overlay), "--engine", "native", "--json"])
    findings = {f["check"]: f for f in json.loads(result.stdout)["findings"]}
    assert "PLE table" in findings["host-ram"]["terms"] and findings["overlay"]["ok"], findings
    assert reads == {config_of(demo_snapshot): 1, index_of(demo_snapshot): 1,
                     config_of(demo_overlay): 1, index_of(demo_overlay): 1,
                     **hashed_by_the_overlay_check(demo_snapshot, demo_overlay), "profile loads": 1, "plans": 1}, \
        result.output


def test_the_native_engines_view_is_written_from_what_the_deployment_read(reads, demo_snapshot, demo_overlay,
                                                                           demo_table, tmp_path, monkeypatch):
    """`serve --engine native --overlay ...` after a GO, its stages in the order serve runs them: the
    PLE-table rule, the preflight (its verdict does not matter here), the command line with the view
    made. The view is the overlay stack the deployment read, written out: nothing read again."""
    from flashnext.serving import preflight as pf
    from flashnext.serving.run import native_command, require_ple_table

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    deployment = resolve_deployment("3x3090", demo_snapshot, [demo_overlay], demo_table)
    require_ple_table(deployment)
    pf.preflight(deployment, "native", devices=[])
    cmd, _ = native_command(deployment, "127.0.0.1", 8000, verified=True)
    served = Path(cmd[2])
    assert os.readlink(served / "config.json") == str(demo_overlay.absolute() / "config.json")
    assert os.readlink(served / "model.safetensors.index.json") == str(demo_overlay.absolute() /
                                                                       "model.safetensors.index.json")
    assert reads == {config_of(demo_snapshot): 1, index_of(demo_snapshot): 1,
                     config_of(demo_overlay): 1, index_of(demo_overlay): 1,
                     **hashed_by_the_overlay_check(demo_snapshot, demo_overlay), "profile loads": 1, "plans": 1}


@pytest.fixture(scope="module")
def ple_overlay(demo_snapshot, tmp_path_factory) -> Path:
    """The demo's PLE table as NVFP4: `flashnext ple build --format nvfp4`'s overlay."""
    from flashnext.quant.overlays.ple_quant import quantize_ple_table

    out = tmp_path_factory.mktemp("ple") / "nvfp4"
    quantize_ple_table(demo_snapshot, out, "nvfp4")
    return out


@pytest.mark.parametrize("ple_last", [True, False], ids=["mtp-then-ple", "ple-then-mtp"])
def test_a_stack_of_overlays_is_served_with_every_overlays_changes(ple_last, demo_snapshot, demo_overlay,
                                                                   ple_overlay):
    """Two overlays that both change config.json (the MTP draft's INT4 group, the PLE table's dtype):
    vLLM serves the view's config.json, the base's with both changes merged, whichever comes last.
    Before, the served config was the last overlay's own, so with the MTP overlay last the NVFP4
    table was taken for the BF16 one: `serve` asked for --ple-table and the preflight counted 95 GiB."""
    from flashnext.quant.checkpoint.snapshot import Snapshot, text_config_of
    from flashnext.quant.formats.ct_config import quantization_config_of
    from flashnext.quant.overlays.manifest import OverlayManifest
    from flashnext.quant.ple.source import find_ple_source
    from flashnext.serving.run import require_ple_table

    overlays = (demo_overlay, ple_overlay) if ple_last else (ple_overlay, demo_overlay)
    deployment = resolve_deployment("3x3090", demo_snapshot, overlays)
    served = deployment.served_model
    own = {o: json.loads((o / "config.json").read_text()) for o in overlays}
    assert deployment.ple_format == text_config_of(own[ple_overlay])["ple_embedding_dtype"] == "nvfp4"
    assert set(quantization_config_of(own[demo_overlay])["config_groups"]) <= \
        set(quantization_config_of(served.config)["config_groups"])
    # each overlay's changes to the index (relative to the snapshot's) are served, its files read from
    # it; what no overlay changed is the snapshot's, and what one removed is not served
    base = Snapshot.open(demo_snapshot)
    shipped = {e.path for o in overlays for e in OverlayManifest.load(o).files}
    for overlay in overlays:
        index = json.loads((overlay / "model.safetensors.index.json").read_text())["weight_map"]
        changed = {name: file for name, file in index.items() if base.weight_map.get(name) != file}
        assert changed and all(served.weight_map[name] == file and served.path(file) == overlay / file
                               for name, file in changed.items()), overlay
        assert not {name for name in base.weight_map if name not in index} & set(served.weight_map)
    assert all(served.path(file) == base.path(file) for file in served.weight_map.values() if file not in shipped)
    # the pinned table is the NVFP4 overlay's codes and block scales; no table file is asked for
    source = find_ple_source(base)
    rows, d = source.layout.padded_rows, source.row_elements
    assert sorted(ledger.ple_table_allocations(served)) == sorted([rows * d // 2, rows * d // 16])
    require_ple_table(deployment)


def test_a_failed_read_is_said_again_without_reading_again(reads, tmp_path):
    """A config.json that cannot be read is read once: every stage that asks again (the plan too)
    gets the same one-line error, as a plan that cannot be made is planned once."""
    model = tmp_path / "snapshot"
    model.mkdir()
    (model / "config.json").write_text("{not JSON")
    deployment = resolve_deployment("3x3090", model)
    said = set()
    for _ in range(3):
        for stage in ("model_config", "plan", "snapshot"):
            with pytest.raises(FlashnextError) as caught:
                getattr(deployment, stage)
            said.add(str(caught.value))
    assert len(said) == 1 and "config.json" in said.pop()
    assert reads == {config_of(model): 1, "profile loads": 1}


# --- the selftest ---------------------------------------------------------------------------------------

def test_selftest_resolves_its_deployment_once(reads, tmp_path, monkeypatch):
    """`flashnext selftest` loads its profile once (the tool resolves the Deployment) and reads no
    config.json but those of the demo checkpoint it writes in its own scratch folder. The vLLM
    interpreter it starts (the kernel fit and the PLE read-back, a fresh process whose reads are not
    this one's) is stood in for, and the series check with it (minutes, and covered by
    tests/serving/selftest/test_selftest_cpu.py)."""
    import tempfile

    from flashnext.serving.selftest import ple_formats, runner
    from flashnext.serving.selftest.report import KernelFit, SeriesCheck

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(runner, "check_series", lambda patches: SeriesCheck(status="failed", detail="stand-in",
                                                                            patches=[]))

    def in_vllm(config, workdir, tree, snapshot, built):  # the vLLM interpreter's stand-in
        fit = KernelFit(status="passed", detail="stand-in", capabilities=[86, 90], layers=[], stand_in="stand-in")
        return fit, ple_formats.judge(snapshot, built, None, "stand-in")

    monkeypatch.setattr(runner, "check_in_vllm", in_vllm)
    result = CliRunner().invoke(cli, ["selftest", "--out", str(tmp_path / "report"), "--gpus", "0"])
    assert result.exit_code == 1 and (tmp_path / "report" / "report.json").is_file(), result.output
    assert reads["profile loads"] == 1 and "plans" not in reads
    outside = [k for k in reads if k != "profile loads" and scratch.as_posix() not in str(k)]
    assert not outside, outside
