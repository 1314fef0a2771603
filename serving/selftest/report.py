"""``report.json`` of ``flashnext selftest`` (schema: ``manifests/selftest-report.schema.json``).

Every model rejects unknown keys, as bench's report does: a report from another version fails
loudly rather than being half read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flashnext.errors import FlashnextError
from flashnext.quant.records.jsonfile import read_json

# 2: the PLE formats' check and the A/B of the PLE table as NVFP4 against BF16.
SCHEMA_VERSION = 2

# A check's outcome. "could_not_run" is not a failure: it says what this machine cannot run and why.
Status = Literal["passed", "failed", "could_not_run"]
Verdict = Literal["agree", "disagree", "could_not_run"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Machine(_Model):
    cuda_gpus: int = Field(description="CUDA GPUs the selftest may use (--gpus, or as many as NVML counts)")
    gpu_names: list[str]
    vllm_version: str | None = Field(description="the installed vLLM's version; null: not installed")
    vllm_patched: bool | None = Field(description="every patch's probe passes on the installed vLLM itself "
                                                  "(the serving image's); null: not checked")
    unpatched_probe: str | None = Field(description="the first patch whose probe fails on the installed vLLM")


class SeriesCheck(_Model):
    """``flashnext patches check`` against the installed vLLM (a shadow copy; zero fuzz; probes)."""

    status: Status
    detail: str
    patches: list[str] = Field(description="the patches that applied, compiled and passed their probe")


class KernelLayer(_Model):
    """One quantized layer of the demo checkpoint as vLLM builds it, at one compute capability."""

    layer: str = Field(description="the module vLLM builds (a merged one names its parts)")
    kind: Literal["linear", "moe"]
    weight_type: str = Field(description="vLLM's scalar type, e.g. uint4b8")
    group_size: int
    k: int = Field(description="input features (per partition)")
    n: int = Field(description="output features (per partition); for MoE the intermediate size")
    capability: int = Field(description="compute capability, e.g. 86 for the RTX 3090, 90 for the H100/H200")
    kernel: str | None = Field(description="what vLLM's chooser picked; null: none can implement the layer")
    marlin: str = Field(description="Marlin's own verdict: 'ok' or its reason")
    humming: str = Field(description="Humming's own verdict: 'ok' or its reason")
    reasons: list[str] = Field(description="why the chooser rejected the kernels before its pick (or all)")


class KernelFit(_Model):
    status: Status
    detail: str
    capabilities: list[int]
    layers: list[KernelLayer]
    stand_in: str = Field(description="what the check supplies because no GPU is asked: the device's capability")


class KernelChoice(_Model):
    """One decision of the launch table between flashnext's own kernel variants, timed both ways on
    this machine's GPU (:mod:`flashnext.quant.kernels.choices`)."""

    decision: str = Field(description="the table's row kind: bitplane_matmul, bitplane_mlp or bitplane_gemm")
    shape: str
    tokens: int
    table_picks: str = Field(description="the variant the table picks on this GPU")
    fastest: str = Field(description="the variant that measured fastest here")
    agrees: bool = Field(description="the pick is within 5% of the fastest")
    timings_us: dict[str, float] = Field(description="each variant's CUDA-graph replay, us")


class KernelChoices(_Model):
    status: Status
    detail: str = Field(description="how many points agree, and for each that does not, the row to add")
    device: str | None
    points: list[KernelChoice]


class PleFormatCheck(_Model):
    """The demo's PLE table built as one format (``flashnext ple build --format``) and read back
    through vLLM 0.34.0's own ``Qwen4ExpNGramEmbedding``."""

    format: Literal["nvfp4", "fp8"]
    ple_embedding_dtype: str = Field(description="what the overlay's config.json says, which picks vLLM's method")
    status: Status
    detail: str
    vllm_method: str | None = Field(description="the PLE method vLLM chose for the overlay's config")
    vllm_backend: str | None = Field(description="the PLE embedding class vLLM built")
    rows: int = Field(description="rows of the table vLLM returned (all of them)")
    rows_differing: int | None = Field(description="rows not bit for bit flashnext's decoder's (0: exact)")
    relative_mse: float | None = Field(description="squared error of vLLM's rows against the BF16 rows over the "
                                                   "BF16 rows' squared sum, on the demo's table (not the real model's)")
    error_bound: float = Field(description="the most relative_mse the format gives on the demo's table, with headroom")
    allocated_bytes: list[int] = Field(description="each tensor vLLM's method asked its embedding to allocate")
    preflight_bytes: list[int] = Field(description="each tensor the preflight counts as pinned for this table")


class PleFormats(_Model):
    status: Status
    detail: str
    stand_in: str = Field(description="what the CPU cannot run: the served (pinned-host) backend")
    formats: list[PleFormatCheck]


class RunResult(_Model):
    """One ``vllm serve`` of the demo checkpoint and the short bench run against it."""

    name: str = Field(description="'on' (every patch on), 'on-again' (the A/A rerun) or 'off:<patch>'")
    env: dict[str, str] = Field(description="the switches this run set")
    started: bool
    error: str | None = Field(description="why the server or the bench failed (the log's last line)")
    bench_report: str | None = Field(description="the bench report.json, relative to the selftest's --out")
    decode_tok_s: float | None = Field(description="decode tok/s, 1 concurrent, median of the rounds")
    itl_p50_s: float | None


class Agreement(_Model):
    by: Literal["tokens", "characters"]
    answers: int
    identical: int
    matching_fraction: float
    mean_kl_nats: float | None


class PatchResult(_Model):
    id: str
    env_switch: str
    probe: Status = Field(description="its probe on the patched shadow tree (part of the series check)")
    kernel_fit: Status | None = Field(description="for patches that run quantized layers: the kernel-fit check")
    ab: Verdict = Field(description="switch off against on, beside the A/A noise floor")
    ab_detail: str = Field(description="the numbers behind the verdict, or what could not run here and why")
    agreement: Agreement | None
    decode_change_pct: float | None = Field(description="decode tok/s with the switch off against on (+: faster off)")


class PleFormatAB(_Model):
    """The demo served with its PLE table as NVFP4 (a view of the overlay the CPU part built, no
    ``VLLM_PLE_MMAP_PATH``: vLLM's own method, pinned host memory) against the first run's BF16
    table, as ``flashnext bench --against``/``--baseline`` compares them, beside the A/A floor."""

    format: Literal["nvfp4"]
    status: Status = Field(description="passed: served and benched with the overlay; failed: the server did not "
                                       "start with it, or requests failed; could_not_run: why not here")
    against_floor: Verdict = Field(description="token agreement and mean KL held to the thresholds the patches are: "
                                               "informational, since a format changes the numbers by design, and "
                                               "the demo's change says nothing of the real model's")
    detail: str
    run: str | None = Field(description="its entry in runs")
    agreement: Agreement | None
    decode_change_pct: float | None = Field(description="decode tok/s against the BF16 run (+: faster as NVFP4)")


class Thresholds(_Model):
    matching_slack: float = Field(description="a patch agrees when its token agreement is at least the A/A "
                                              "floor's minus this")
    kl_factor: float = Field(description="... and its mean KL at most this times the A/A floor's ...")
    kl_abs_nats: float = Field(description="... or at most this many nats, whichever is larger")


class Summary(_Model):
    ok: bool = Field(description="everything that ran passed or agreed; the exit status is 0 only then")
    passed: int
    failed: int
    could_not_run: int
    lines: list[str] = Field(description="one line per failure and per part that could not run")


def headline(s: Summary) -> str:
    """The verdict in a few words: OK only when every check ran and passed; PARTIAL when all that
    ran passed but some could not run here (the exit status is still 0: a machine without GPUs
    runs what it can), FAILED when any failed."""
    ran = s.passed + s.failed
    total = ran + s.could_not_run
    if s.failed:
        return f"FAILED: {s.failed} of the {ran} checks that ran failed, {s.could_not_run} could not run here"
    if s.could_not_run:
        return f"PARTIAL: {ran} of {total} checks ran, all passed; {s.could_not_run} could not run here"
    return f"OK: all {total} checks passed"


class SelftestReport(_Model):
    schema_version: Literal[2] = SCHEMA_VERSION
    flashnext_version: str
    started_at: str
    finished_at: str
    profile: str
    machine: Machine
    series: SeriesCheck
    kernel_fit: KernelFit
    ple_formats: PleFormats
    gpu_part: Status
    gpu_detail: str
    vllm_command: list[str] = Field(description="the `vllm serve` command line the GPU part runs (or would)")
    thresholds: Thresholds
    kernel_choices: KernelChoices | None = Field(
        default=None, description="the launch table's picks timed on the first GPU; null: not run (no CUDA GPU)")
    runs: list[RunResult]
    noise_floor: Agreement | None = Field(description="the A/A rerun against the first run, all patches on")
    patches: list[PatchResult]
    ple_format_ab: PleFormatAB
    summary: Summary


def load_report(path: Path) -> SelftestReport:
    data = read_json(path, "a selftest report")
    try:
        return SelftestReport.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the top level"
        raise FlashnextError(f"{path}: not a flashnext selftest report (schema {SCHEMA_VERSION}): "
                             f"{first['msg']} at {where}")

