"""Issue 26 class 6: no builder writes an output that flashnext itself then refuses, and plausible
inputs (ones the safetensors library accepts, configs as odd as JSON allows) never exit 70.

Each case ends in one line and exit 1 with the tree unchanged, or, for a rewrite the format can
represent (0-element tensors), in an output that reads back. The builder-side cases also check that
no output (nor a partial, journal or sidecar of one) was created.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from flashnext.tools.cli import main as cli
from support.hostile import (
    assert_refused,
    FIRST_SHARD,
    INDEX,
    MTP_SHARD,
    Case,
    Work,
    apply,
    config_case,
    edit_header,
    invoke_expecting_one_line,
    mtp,
    ple_build,
    ple_verify,
    repack,
    sidecar_case,
    text,
    tree_state,
)
from support.shards import rewrite_shard

PLE_PREFIX = "model.language_model.layers.1.ple.ple_embedding"
PLE_SCALE = f"{PLE_PREFIX}.ngram_embedding.weight_scale"
# A value no demo file holds, put where a number goes and then replaced in the text (json.dumps
# cannot write 1e400 itself: it would write Infinity).
PLACEHOLDER = 8765.4321


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def literal_case(file: Callable[[Work], Path], edit: Callable[[object], None], literal: str,
                 command: Callable[[Work], list[str]]) -> Callable[[Work], list[str]]:
    """``edit`` puts :data:`PLACEHOLDER` somewhere in a JSON file, which then reads ``literal`` there
    (JSON text that Python's own encoder would not write)."""
    def setup(w: Work) -> list[str]:
        path = file(w)
        w.edit_json(path, edit)
        path.write_text(path.read_text().replace(repr(PLACEHOLDER), literal))
        return command(w)
    return setup


def placeholder_at(key: str):
    def edit(config):
        config["text_config"][key] = PLACEHOLDER
    return edit


def config_file(w: Work) -> Path:
    return w.snap / "config.json"


def ple_ids(w: Work) -> list[str]:
    return ["ple", "ids", "--config", str(w.snap / "config.json"), "--tokens", "1,2"]


def apply_unverified(w: Work) -> list[str]:
    return apply(w, "--no-verify")


def with_calib(top_k: int) -> Callable[[Work], list[str]]:
    def setup(w: Work) -> list[str]:
        w.edit_json(w.snap / "config.json", lambda c: c["text_config"].update(num_experts_per_tok=top_k))
        calib = w.root / "calib.safetensors"
        save_file({"hidden_states": torch.randn(64, 256, generator=torch.Generator().manual_seed(0))}, str(calib))
        return mtp(w, "--calib", str(calib))
    return setup


def ple_shard_file(w: Work) -> str:
    import json

    return json.loads((w.snap / INDEX).read_text())["weight_map"][f"{PLE_PREFIX}.ngram_embedding.shard_0.weight"]


def to_fp8(w: Work, scale: torch.Tensor | None, dtype: str | None = None) -> None:
    """The PLE shards as F8_E4M3 with the global ``scale`` (stored as ``dtype`` when given: a dtype
    torch cannot write, by header surgery on a tensor of the same size)."""
    shard = ple_shard_file(w)

    def edit(tensors):
        for k in list(tensors):
            if ".ngram_embedding.shard_" in k:
                tensors[k] = tensors[k].float().clamp(-400, 400).to(torch.float8_e4m3fn)
        if scale is not None:
            tensors[PLE_SCALE] = scale

    rewrite_shard(w.snap / shard, edit)
    if dtype is not None:
        edit_header(w.snap / shard, lambda h: h[PLE_SCALE].update(dtype=dtype))
    if scale is not None:
        w.edit_json(w.snap / INDEX, lambda i: i["weight_map"].update({PLE_SCALE: shard}))


def fp8_scale(scale: torch.Tensor, dtype: str | None = None) -> Callable[[Work], list[str]]:
    def setup(w: Work) -> list[str]:
        to_fp8(w, scale, dtype)
        return ple_build(w)
    return setup


def fp8_table_sidecar(literal: str) -> Callable[[Work], list[str]]:
    """A good FP8 table whose sidecar then says its scale is ``literal``: ``ple verify`` refuses it."""
    def setup(w: Work) -> list[str]:
        from flashnext.quant.ple.table import build_table

        to_fp8(w, torch.tensor([0.015625]))
        table = w.root / "fp8.bin"
        build_table(w.snap, table, progress=False)
        sidecar = w.root / "fp8.bin.json"
        sidecar.write_text(sidecar.read_text().replace('"scale": 0.015625', f'"scale": {literal}'))
        return ["ple", "verify", str(table)]
    return setup


def non_finite(value: float, tensor: str, shard: Callable[[Work], str], command, index=(1, 2)):
    """One element of a source tensor made ``value`` (issue 42: a NaN dropped from a running
    maximum gave NVFP4 a global scale of 1.0, exit 0; an Inf gave every scale inf)."""
    def setup(w: Work) -> list[str]:
        def edit(tensors):
            t = tensors[tensor].clone()
            t[index] = value
            tensors[tensor] = t

        rewrite_shard(w.snap / shard(w), edit)
        return command(w)
    return setup


PLE_ROWS = f"{PLE_PREFIX}.ngram_embedding.shard_0.weight"
MTP_EXPERTS = "mtp.layers.0.mlp.experts.gate_up_proj"

CASES = [
    # Non-finite weights in a source every builder that computes from them reads: refused, naming the
    # tensor and the first bad index. (repack-int6 moves integer words only; its scales are not read.)
    Case("ple-nvfp4-nan", non_finite(float("nan"), PLE_ROWS, ple_shard_file, lambda w: ple_build(w, "--format", "nvfp4")),
         f"{PLE_PREFIX} (model-00003-of-00005.safetensors) holds nan at index [1, 2]"),
    Case("ple-fp8-inf", non_finite(float("inf"), PLE_ROWS, ple_shard_file, lambda w: ple_build(w, "--format", "fp8")),
         "holds inf at index [1, 2]: refusing to quantize non-finite weights"),
    Case("ple-nvfp4-minus-inf", non_finite(float("-inf"), PLE_ROWS, ple_shard_file,
                                           lambda w: ple_build(w, "--format", "nvfp4")), "holds -inf at index [1, 2]"),
    Case("mtp-nan", non_finite(float("nan"), MTP_EXPERTS, lambda w: MTP_SHARD, mtp, index=(3, 1, 2)),
         "mtp.layers.0.mlp.experts gate_proj of experts 0..3 holds nan at index [3, 1, 2]"),
    Case("mtp-inf-calibrated", non_finite(float("inf"), MTP_EXPERTS, lambda w: MTP_SHARD,
                                          lambda w: with_calib(2)(w), index=(5, 0, 0)), "holds inf at index [5, 0, 0]"),
    # Numbers that only read as numbers: 1e400 is inf to Python, and json.dumps would write it back
    # as Infinity, which no JSON reader (flashnext's included) accepts.
    Case("config-1e400-mtp", literal_case(config_file, placeholder_at("rms_norm_eps"), "1e400", mtp),
         "number 1e400 is out of range"),
    Case("config-minus-1e400-repack", literal_case(config_file, placeholder_at("rms_norm_eps"), "-1e400", repack),
         "number -1e400 is out of range"),
    Case("config-1e400-ple-build", literal_case(config_file, placeholder_at("rms_norm_eps"), "1e400", ple_build),
         "number 1e400 is out of range"),
    Case("overlay-config-1e400-apply", literal_case(lambda w: w.ov / "config.json", placeholder_at("rms_norm_eps"),
                                                   "1e400", apply_unverified), "number 1e400 is out of range"),
    Case("sidecar-fp8-scale-1e400-verify", fp8_table_sidecar("1e400"), "number 1e400 is out of range"),
    # Nesting 600 deep: valid JSON, but every copy, merge and validator after the parse would recurse.
    Case("config-nested-600-mtp", config_case(lambda c: c.update(extra=nested(600))), "nested more than"),
    Case("config-nested-600-repack", config_case(lambda c: c.update(extra=nested(600)), command=repack),
         "nested more than"),
    Case("config-nested-600-ple-build", config_case(lambda c: c.update(extra=nested(600)), command=ple_build),
         "nested more than"),
    Case("config-nested-600-ple-ids", config_case(lambda c: c.update(extra=nested(600)), command=ple_ids),
         "nested more than"),
    Case("index-nested-600", config_case(lambda i: i.update(metadata={"x": nested(600)}), file=INDEX),
         "nested more than"),
    Case("manifest-nested-600-apply", lambda w: (w.edit_json(w.ov / "overlay.json",
                                                             lambda m: m["report"].update(x=nested(600))),
                                                 apply_unverified(w))[1], "nested more than"),
    # Integers past int64 where vLLM holds them in an int64.
    Case("eos-past-int64-ple-ids", config_case(text("eos_token_id", 2**63), command=ple_ids), "eos_token_id"),
    Case("eos-past-int64-ple-build", config_case(text("eos_token_id", 2**64), command=ple_build), "eos_token_id"),
    Case("sidecar-eos-past-int64-verify", sidecar_case(lambda s: s["layout"].update(eos_token_id=2**63), ple_verify),
         "eos_token_id"),
    # --calib routes each token to num_experts_per_tok distinct experts.
    Case("calib-top-k-above-experts", with_calib(9), "num_experts_per_tok 9 is more than num_experts 8"),
    # The FP8 table's global scale, in the checkpoint (ple build) and in the sidecar (ple verify).
    Case("fp8-scale-nan", fp8_scale(torch.tensor([float("nan")])), "must be finite and positive"),
    Case("fp8-scale-minus-zero", fp8_scale(torch.tensor([-0.0])), "is -0.0; the FP8 PLE table's global scale"),
    Case("fp8-scale-zero", fp8_scale(torch.tensor(0.0)), "must be finite and positive"),
    Case("fp8-scale-inf", fp8_scale(torch.tensor([float("inf")], dtype=torch.bfloat16)), "must be finite and positive"),
    Case("fp8-scale-negative", fp8_scale(torch.tensor([-0.5])), "must be finite and positive"),
    Case("fp8-scale-empty", fp8_scale(torch.zeros(0)), "has shape [0]"),
    Case("fp8-scale-two-values", fp8_scale(torch.tensor([0.5, 0.25])), "has shape [2]"),
    Case("fp8-scale-u64", fp8_scale(torch.tensor([1], dtype=torch.int64), dtype="U64"), "is U64"),
    Case("fp8-scale-int32", fp8_scale(torch.tensor([1], dtype=torch.int32)), "is I32"),
    Case("sidecar-fp8-scale-minus-zero", fp8_table_sidecar("-0.0"), "scale must be more than 0.0"),
    Case("sidecar-fp8-scale-negative", fp8_table_sidecar("-1.5"), "scale must be more than 0.0"),
    Case("sidecar-fp8-scale-missing", fp8_table_sidecar("null"), "needs its global scale"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_in_one_line(case: Case, work: Work):
    assert_refused(case, work)


# --- the builder side: what a builder is about to write is read back first ---------------------------

@dataclass(frozen=True)
class BuilderCase:
    id: str
    setup: Callable[[Work], list[str]]
    message: str
    output: str  # what the command would have created, relative to the work tree
    patch: Callable[[pytest.MonkeyPatch, Work], None] | None = None


def header_limit_below_output(monkeypatch: pytest.MonkeyPatch, w: Work) -> None:
    """Once the build has read all it reads (its manifest is written last), readers allow exactly the
    source MTP shard's header length: the rewritten shard's header, with tensors per expert, is
    longer, so ``read_header`` (which a view opened as a snapshot uses) would refuse it, as it
    refuses a real one past ``HEADER_LIMIT``."""
    import struct

    import flashnext.quant.formats.safetensors_io as io
    from flashnext.quant.overlays.manifest import OverlayManifest

    (length,) = struct.unpack("<Q", (w.snap / MTP_SHARD).read_bytes()[:8])
    write = OverlayManifest.write

    def write_then_lower_the_limit(self, *args, **kwargs):
        written = write(self, *args, **kwargs)
        monkeypatch.setattr(io, "HEADER_LIMIT", length)
        return written

    monkeypatch.setattr(OverlayManifest, "write", write_then_lower_the_limit)


def negative_head_size(w: Work) -> list[str]:
    """The checkpoint's own head sizes (which win over the formula, as in vLLM) with one negative and
    the sum unchanged: the shards still fit, the sidecar's layout would not."""
    name = f"{PLE_PREFIX}.ngram_heads_vocab_sizes"
    import json

    shard = json.loads((w.snap / INDEX).read_text())["weight_map"][name]

    def edit(tensors):
        sizes = tensors[name].clone()
        sizes[1] += sizes[0] + 1
        sizes[0] = -1
        tensors[name] = sizes

    rewrite_shard(w.snap / shard, edit)
    return ple_build(w)


BUILDER_CASES = [
    BuilderCase("mtp-shard-header-read-back", mtp, "refused when read back", "out", header_limit_below_output),
    BuilderCase("ple-sidecar-read-back", negative_head_size, "its sidecar would be refused when read back",
                "new.bin"),
    BuilderCase("ple-fp8-scale-nan", fp8_scale(torch.tensor([float("nan")])), "must be finite and positive",
                "new.bin"),
    BuilderCase("mtp-config-1e400", literal_case(config_file, placeholder_at("rms_norm_eps"), "1e400", mtp),
                "out of range", "out"),
]


@pytest.mark.parametrize("case", BUILDER_CASES, ids=[c.id for c in BUILDER_CASES])
def test_a_builder_never_writes_what_it_would_refuse(case: BuilderCase, work: Work, monkeypatch):
    argv = case.setup(work)
    if case.patch is not None:
        case.patch(monkeypatch, work)
    before = tree_state(work.root)
    result, line = invoke_expecting_one_line(argv)
    assert result.exit_code == 1, line
    assert line.startswith("Error: ") and case.message in line, line
    assert tree_state(work.root) == before, "the command wrote or removed something"
    made = [p.name for p in work.root.iterdir() if p.name.lstrip(".").startswith(case.output)]
    assert not made, made


# --- 0-element tensors: safetensors has them, a rewrite keeps them ----------------------------------

def with_empty_tensor(shard: str, shape: tuple[int, ...]) -> Callable[[Work], None]:
    def setup(w: Work) -> None:
        rewrite_shard(w.snap / shard, lambda t: t.update({"extra.empty": torch.zeros(shape, dtype=torch.bfloat16)}))
        w.edit_json(w.snap / INDEX, lambda i: i["weight_map"].update({"extra.empty": shard}))
    return setup


EMPTY_CASES = [
    ("mtp-rewrites-a-shard-with-an-empty-tensor", MTP_SHARD, (0,), mtp),
    ("mtp-rewrites-a-shard-with-an-empty-matrix", MTP_SHARD, (4, 0), mtp),
    ("repack-rewrites-a-shard-with-an-empty-matrix", FIRST_SHARD, (0, 3), repack),
]


@pytest.mark.parametrize("shard,shape,command", [c[1:] for c in EMPTY_CASES], ids=[c[0] for c in EMPTY_CASES])
def test_empty_tensors_pass_through_a_rewrite(shard, shape, command, work: Work):
    with_empty_tensor(shard, shape)(work)
    result = CliRunner().invoke(cli, command(work))
    assert result.exit_code == 0, result.output
    written = work.root / "out" / shard
    with safe_open(str(written), "pt") as f:  # the safetensors library reads it back, as vLLM does
        assert tuple(f.get_tensor("extra.empty").shape) == shape
    view = work.root / "view"
    assert CliRunner().invoke(cli, ["overlay", "apply", str(work.root / "out"), "--base", str(work.snap),
                                    "--out", str(view)]).exit_code == 0
    assert CliRunner().invoke(cli, ["overlay", "verify", str(view)]).exit_code == 0


# --- a full disk at the PLE table's sidecar (issue 42) ----------------------------------------------

SIDECAR_TMP = ".new.bin.json.tmp-"  # the sidecar's temporary name (fsutil.write_text_at), beside new.bin


def _is_sidecar(fd: int) -> bool:
    import os

    return SIDECAR_TMP in os.readlink(f"/proc/self/fd/{fd}")


def _enospc():
    import errno
    import os

    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_at_the_sidecar_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar's file takes half its text, then the disk is full (a short write, then ENOSPC)."""
    import os

    real = os.fdopen

    class HalfThenFull:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[:len(text) // 2])
            self.f.flush()
            raise _enospc()

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        return HalfThenFull(f) if _is_sidecar(fd) else f

    monkeypatch.setattr(os, "fdopen", fdopen)


def full_at_the_sidecar_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar's text is taken, and the full disk is reported only at its fsync (delayed allocation)."""
    import os

    real = os.fsync

    def fsync(fd):
        if _is_sidecar(fd):
            raise _enospc()
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


DISK_FULL = {"write": full_at_the_sidecar_write, "fsync": full_at_the_sidecar_fsync}


@pytest.mark.parametrize("replacing", [False, True], ids=["new", "force-over-a-table"])
@pytest.mark.parametrize("where", sorted(DISK_FULL))
def test_a_full_disk_at_the_ple_sidecar_leaves_no_finished_looking_output(where: str, replacing: bool, work: Work,
                                                                          monkeypatch):
    """Issue 42 item 6: the table and its sidecar are one output. A full disk while the sidecar is
    written is one line and exit 1; no new table and sidecar appear (not even half a sidecar), a
    table --force was replacing stays as it was, with its own sidecar; only the resumable partial and
    its journal are left, and the next run finishes."""
    argv = ple_build(work, *(["--force"] if replacing else []))
    if replacing:
        assert CliRunner().invoke(cli, ple_build(work)).exit_code == 0
    before = {k: v for k, v in tree_state(work.root).items() if k.startswith("new.bin")}
    DISK_FULL[where](monkeypatch)
    result, line = invoke_expecting_one_line(argv)
    monkeypatch.undo()
    assert result.exit_code == 1 and line.startswith("Error: ") and "No space left on device" in line, line
    after = tree_state(work.root)
    assert sorted(k for k in after if k.lstrip(".").startswith("new.bin") and k not in before) == \
        ["new.bin.partial", "new.bin.partial.json"], sorted(after)
    assert {k: after[k] for k in before} == before, "the table or the sidecar it replaces changed"
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    verify = CliRunner().invoke(cli, ["ple", "verify", "--full", "--no-progress", str(work.root / "new.bin")])
    assert verify.exit_code == 0, verify.output
