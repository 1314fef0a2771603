"""What users install: the built wheel, installed non-editable into a fresh venv without vLLM,
runs the README's main job and the serving commands that need no vLLM."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from test_project import readme_commands

from flashnext.serving.patches.series import VLLM_VERSION
from support import ROOT, no_torch

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def package_folder(package: str) -> Path:
    """The folder setuptools builds ``package`` from: its nearest mapped ancestor in ``package-dir``
    plus the remaining parts of the name."""
    mapped = SETUPTOOLS["package-dir"]
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in mapped:
            return ROOT / mapped[head] / Path(*parts[cut:]) if cut < len(parts) else ROOT / mapped[head]
    return ROOT / Path(*parts)


def source_files() -> dict[str, Path]:
    """Every file the wheel must carry, by its path inside the wheel."""
    wanted = {}
    for package in SETUPTOOLS["packages"]:
        folder = package_folder(package)
        inside = package.replace(".", "/")
        for path in folder.glob("*.py"):
            wanted[f"{inside}/{path.name}"] = path
        for pattern in SETUPTOOLS.get("package-data", {}).get(package, []):
            for path in folder.glob(pattern):
                wanted[f"{inside}/{path.relative_to(folder)}"] = path
    return wanted


def test_every_source_folder_is_a_package():
    """A folder of Python code left out of ``packages`` would be left out of the wheel."""
    mapped = {ROOT / d for d in SETUPTOOLS["package-dir"].values()}
    packaged = set()
    for package in SETUPTOOLS["packages"]:
        packaged.add(package_folder(package))
    for top in mapped:
        for init in top.rglob("__init__.py"):
            assert init.parent in packaged, f"{init.parent} is not in [tool.setuptools] packages"
    for folder in ("serving/profiles", "serving/patches"):
        assert any((ROOT / folder).iterdir())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the tree: setuptools' ``build/`` in the checkout could carry
    modules that no longer exist into the wheel, and the test must not leave one behind."""
    src = tmp_path_factory.mktemp("src") / "flashnext"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "demo", ".whl", ".bench"))
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(src)], check=True, cwd=dist)
    (wheel,) = dist.glob("flashnext-*.whl")
    return wheel


@pytest.mark.slow
def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = source_files()
    missing = sorted(set(expected) - names)
    assert not missing, missing
    unexpected = sorted(n for n in names if n.endswith(".py") and n not in expected)
    assert not unexpected, unexpected
    stray = sorted(n for n in names if n.startswith(("tests/", "benchmarks/", "docs/")))
    assert not stray, stray
    for required in ("flashnext/serving/hooks/ple_file.py", "flashnext/quant/kernels/bitplane_gemv.py",
                     "flashnext/serving/patches/series.py", "flashnext/serving/patches/qsa-offload.patch", "flashnext/serving/patches/int6-bitplane.md",
                     "flashnext/serving/profiles/3x3090.json",
                     "flashnext/manifests/overlay.schema.json", "flashnext/manifests/qwen3.8-flash-next.json",
                     f"flashnext/manifests/vllm-{VLLM_VERSION}.json",
                     "flashnext/serving/bench/runner.py", "flashnext/manifests/bench-report.schema.json"):
        assert required in names
    metadata = zipfile.ZipFile(wheel).read(f"flashnext-{wheel.name.split('-')[1]}.dist-info/METADATA").decode()
    assert "Requires-Dist: psutil" in metadata
    assert "Requires-Dist: matplotlib>=3.8; extra == \"bench\"" in metadata


# Hub failures in a base install (issue 32): no extra brings an HTTP client of its own, so the mapping
# of huggingface_hub's errors meets only what huggingface_hub itself depends on.
# (id, command after `flashnext`, HF_TOKEN or None, the hint the line must end with)
HUB_TOKEN = "hf_packaging_test_token_0123"
HUB_FAILURES = [
    ("upload-wrong-token", "overlay upload demo/mtp-int4 --repo me/ov --endpoint {hub}", "hf_wrong",
     "log in again with `hf auth login`, or set HF_TOKEN"),
    ("upload-no-token", "overlay upload demo/mtp-int4 --repo me/ov --endpoint {hub}", None,
     "pass a token: `hf auth login`, or set HF_TOKEN"),
    ("upload-refused-port", "overlay upload demo/mtp-int4 --repo me/ov --endpoint {refused}", HUB_TOKEN,
     "check the network, and HF_ENDPOINT or --endpoint"),
    ("fetch-missing-repo", "overlay fetch me/missing --base demo/snapshot --out view --endpoint {hub} --cache-dir c",
     HUB_TOKEN, "check the repository id; if it is private or gated, pass a token: `hf auth login`, or set HF_TOKEN"),
    ("fetch-refused-port", "overlay fetch me/ov --base demo/snapshot --out view --endpoint {refused} --cache-dir c",
     HUB_TOKEN, "check the network, and HF_ENDPOINT or --endpoint"),
]


def hub_failures_are_one_line_with_what_to_do(env: dict, cwd: Path) -> None:
    """Against the Hub stand-in and a port nobody listens on: exit 1, one line ending in the hint."""
    from support.hub_server import HubServer

    hub_settings = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE")
    base_env = {k: v for k, v in env.items() if k not in hub_settings}
    base_env |= {"HF_HUB_DISABLE_XET": "1", "HF_HOME": str(cwd / "hf-home")}
    with HubServer(HUB_TOKEN) as hub:
        for case, command, token, hint in HUB_FAILURES:
            done = subprocess.run("flashnext " + command.format(hub=hub.endpoint, refused="http://127.0.0.1:9"),
                                  shell=True, cwd=cwd, capture_output=True, text=True,
                                  env=base_env | ({"HF_TOKEN": token} if token else {}))
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 1, f"{case}: exit {done.returncode}\n{done.stderr}"
            assert len(lines) == 1 and lines[0].startswith("Error: "), f"{case}: {done.stderr}"
            assert lines[0].endswith(hint), f"{case}: {lines[0]}"
            assert not (cwd / "view").exists() and not (cwd / "demo" / "mtp-int4" / "overlay.published.json").exists()


# What `nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits`
# prints on three 3090s (tests/serving/test_preflight_as_users_meet_it.py has the same stand-in).
FAKE_NVIDIA_SMI = """#!/bin/sh
for i in 0 1 2; do echo "$i, NVIDIA GeForce RTX 3090, 24576, 24250"; done
"""


def base_install_meets_a_rig(env: dict, cwd: Path) -> None:
    """Issue 41, without vLLM: the NVML bindings are installed; where NVML cannot load (no driver
    here) the preflight asks nvidia-smi; Docker's memlock is the compose file's; and the commands
    that need vLLM say in one line what to install."""
    from flashnext.serving.vllm_release import INSTALL

    done = subprocess.run(["python", "-c", "import pynvml; print(pynvml.__file__)"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith(str(Path(env["PATH"].split(os.pathsep)[0]).parent)), \
        done.stderr
    fake_bin = cwd / "fake-bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (fake_bin / "nvidia-smi").chmod(0o755)
    rig_env = {**env, "PATH": f"{env['PATH']}{os.pathsep}{fake_bin}"}
    # the usual 8 MiB `ulimit -l` of a shell (no higher than the hard limit lets it be)
    doctor = subprocess.run("ulimit -S -l 8192 2>/dev/null; flashnext doctor --profile 3x3090 --engine docker --json",
                            shell=True, cwd=cwd, env=rig_env, capture_output=True, text=True)
    assert doctor.stdout.startswith("{"), doctor.stderr
    findings = {f["check"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert "3 x NVIDIA GeForce RTX 3090" in findings["gpus"]["detail"], findings["gpus"]
    assert findings["memlock"]["ok"], findings["memlock"]
    for command in ("flashnext plan --profile 3x3090", "flashnext patches check --no-progress"):
        needs_vllm = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True)
        lines = needs_vllm.stderr.strip().splitlines()
        assert needs_vllm.returncode == 1 and len(lines) == 1 and INSTALL in lines[0], (command, needs_vllm.stderr)


def _constraints(path: Path) -> Path:
    """This environment's versions, so that the fresh venv resolves to wheels pip has cached."""
    versions: dict[str, str] = {}
    for d in importlib.metadata.distributions():  # the first of two installed copies is the one imported
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name and name not in ("flashnext", "vllm"):
            versions.setdefault(name, d.version)
    path.write_text("".join(f"{n}=={v}\n" for n, v in sorted(versions.items())))
    return path


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_main_job(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "-c", str(_constraints(tmp_path / "c.txt")),
                    str(wheel)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"

    def run(command: str) -> subprocess.CompletedProcess:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        return done

    site = run("python -c 'import flashnext, os; print(os.path.dirname(flashnext.__file__))'").stdout.strip()
    assert site.startswith(str(venv)), "the wheel, not the source tree, must be imported"
    assert run("python -c 'import importlib.util as u; print(u.find_spec(\"vllm\") is None)'").stdout.strip() == "True"
    # The README's main job, with the wheel installed in place of `pip install -e .`.
    install, main_job = readme_commands()[0].split(" && ", 1)
    assert install == "pip install -e ."
    run(main_job)
    assert (tmp_path / "demo" / "mtp-int4" / "overlay.json").is_file()
    listing = run("flashnext patches list --json").stdout
    assert '"id": "ple-mmap"' in listing
    assert "3x3090" in run("flashnext serve --help").stdout
    # Without the bench extra, bench says what to install before it measures anything.
    no_extra = subprocess.run("flashnext bench http://127.0.0.1:9 --out b", shell=True, cwd=tmp_path, env=env,
                              capture_output=True, text=True)
    assert no_extra.returncode == 1 and "pip install 'flashnext[bench]'" in no_extra.stderr, no_extra.stderr
    assert not (tmp_path / "b").exists()
    hub_failures_are_one_line_with_what_to_do(env, tmp_path)
    dry_run = "serve --profile 3x3090 --model demo/snapshot --ple-table demo/ple.bin --dry-run"
    missing = subprocess.run(dry_run, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and "--ple-table demo/ple.bin does not exist on this host" in missing.stderr
    run("flashnext ple build --src demo/snapshot --out demo/ple.bin --no-progress")
    profiles = run(dry_run).stdout
    assert "vllm serve" in profiles or "services:" in profiles
    base_install_meets_a_rig(env, tmp_path)
    # Commands that need no torch start without importing it.
    probe = ("import sys, time; t = time.perf_counter(); from flashnext.tools.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(time.perf_counter() - t, 'torch' in sys.modules)")
    seconds, imported = run(f"python -c \"{probe}\"").stdout.split()[-2:]
    assert imported == "False", "flashnext --help imported torch"
    print(f"flashnext --help in the fresh venv: {float(seconds):.3f} s in-process")
    # Refusals and tensor-free commands of the installed wheel answer before torch is imported.
    for argv, code in ((["make-mtp-int4", "--src", "demo/snapshot", "--out", "demo/mtp-int4"], 1),
                       (["overlay", "verify", "--base", "demo/snapshot", "demo/mtp-int4"], 0),
                       (["ple", "ids", "--config", "demo/snapshot/config.json", "--tokens", "1,2,3"], 0)):
        result, stderr = no_torch.probe(argv, tmp_path, python=str(bin_dir / "python"), env=env)
        assert result == {"code": code, "torch": False}, f"{argv}: {result}\n{stderr}"
