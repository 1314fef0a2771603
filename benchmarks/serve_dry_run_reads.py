"""How often one ``serve --dry-run`` (and one ``doctor``) reads its inputs: config.json reads, files
opened under the model directory, profile loads and plan computations, and serve --dry-run's wall time.

    python -m benchmarks.serve_dry_run_reads [--runs 5] [--profile 3x3090-mtp] [--json]

Runs in-process through click's CliRunner on the demo checkpoint (written to a temporary folder),
with its MTP INT4 overlay and a PLE table file (empty: serve checks only that it is there). Opens
count every open, the overlay check's hashing of config.json included. The demo's 4 layers do not
split as 3x3090-mtp's partition asks, so that profile's plan stops at the plan; 3x3090's goes on to
the host terms.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _inputs(root: Path) -> tuple[Path, Path, Path]:
    from flashnext.quant.demo import write_demo_checkpoint
    from flashnext.quant.overlays.mtp_int4 import make_mtp_int4

    model, overlay, table = root / "snapshot", root / "mtp-int4", root / "ple.bin"
    write_demo_checkpoint(model)
    make_mtp_int4(model, overlay, progress=False)
    table.write_bytes(b"")  # serve --dry-run and its plan read only that it exists
    return model, overlay, table


@contextlib.contextmanager
def counting(model: Path, overlay: Path):
    """Counts while the block runs: every open of a file under ``model`` (by ``open`` or ``os.open``),
    the opens of its config.json, profile reads (``profiles._read_profile``) and plans
    (``capacity.qwen4_exp.plan``)."""
    from flashnext.serving import profiles
    from flashnext.serving.capacity import qwen4_exp

    roots = {"model_dir": str(model.absolute()), "overlay_dir": str(overlay.absolute())}
    counts = {"model_dir_opens": 0, "overlay_dir_opens": 0, "config_json_reads": 0, "profile_loads": 0,
              "plan_computations": 0}

    def note(path) -> None:
        if isinstance(path, int):
            return
        text = os.path.abspath(os.fsdecode(path))
        for what, root in roots.items():
            if text == root or text.startswith(root + os.sep):
                counts[f"{what}_opens"] += 1
                counts["config_json_reads"] += text == os.path.join(root, "config.json")

    real_open, real_os_open = builtins.open, os.open
    real_read_profile, real_plan = profiles._read_profile, qwen4_exp.plan

    def open_(file, *a, **kw):
        note(file)
        return real_open(file, *a, **kw)

    def os_open(path, *a, **kw):
        if kw.get("dir_fd") is None:
            note(path)
        return real_os_open(path, *a, **kw)

    def read_profile(*a, **kw):
        counts["profile_loads"] += 1
        return real_read_profile(*a, **kw)

    def plan(*a, **kw):
        counts["plan_computations"] += 1
        return real_plan(*a, **kw)

    builtins.open = io.open = open_
    os.open = os_open
    profiles._read_profile, qwen4_exp.plan = read_profile, plan
    try:
        yield counts
    finally:
        builtins.open = io.open = real_open
        os.open = real_os_open
        profiles._read_profile, qwen4_exp.plan = real_read_profile, real_plan


def _invoke(argv: list[str]) -> None:
    from click.testing import CliRunner

    from flashnext.tools.cli import main

    result = CliRunner().invoke(main, argv)
    if result.exit_code not in (0, 10, 11, 12, 13, 14, 15):  # doctor's NO-GO on a dev machine still counts
        raise SystemExit(f"{' '.join(argv)}: exit {result.exit_code}: {result.output}")


def measure(runs: int, profile: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model, overlay, table = _inputs(Path(tmp))
        serve = ["serve", "--profile", profile, "--model", str(model), "--overlay", str(overlay),
                 "--ple-table", str(table), "--dry-run"]
        doctor = ["doctor", "--profile", profile, "--model", str(model), "--overlay", str(overlay),
                  "--ple-table", str(table), "--engine", "native"]
        _invoke(serve)  # warm: imports and vLLM's parser, as a second run in one process has them
        counts = {}
        # serve without --dry-run stops at the preflight's NO-GO on a machine without GPUs: it has
        # loaded the profile and planned by then
        for what, argv in (("serve_dry_run", serve), ("doctor", doctor),
                           ("serve_native", [a for a in serve if a != "--dry-run"] + ["--engine", "native"])):
            with counting(model, overlay) as counts[what]:
                _invoke(argv)
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            _invoke(serve)
            times.append(time.perf_counter() - started)
    return {"command": " ".join(["flashnext", *serve[:1], "--profile", profile, "--model", "DEMO", "--overlay",
                                 "MTP_INT4", "--ple-table", "TABLE", "--dry-run"]),
            **counts,
            "serve_dry_run_wall_s": {"median": round(statistics.median(times), 4), "min": round(min(times), 4),
                                     "runs": runs}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", default="3x3090-mtp")
    parser.add_argument("--json", action="store_true", help="Print the numbers as JSON.")
    args = parser.parse_args()
    result = measure(args.runs, args.profile)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(result["command"])
    for what in ("serve_dry_run", "doctor", "serve_native"):
        print(f"{what}: " + ", ".join(f"{k} {v}" for k, v in result[what].items()))
    wall = result["serve_dry_run_wall_s"]
    print(f"serve --dry-run wall: median {wall['median']} s, min {wall['min']} s ({wall['runs']} runs, in-process)")


if __name__ == "__main__":
    main()
