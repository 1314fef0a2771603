"""``flashnext ple build --format nvfp4|fp8``: the PLE table as an overlay that vLLM 0.34.0's own PLE
methods read. vLLM's ``Qwen4ExpNGramEmbedding`` for the demo, built from the view's config on the
CPU, loads the overlay through its own ``load_weights`` and returns, for random ids, exactly the rows
flashnext's decoder gives, within the format's error of the BF16 rows. (vLLM's pinned-host backend
needs a CUDA driver; the device-resident one reads the same parameters.)"""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from flashnext.errors import FlashnextError
from flashnext.quant.formats import float_rows
from flashnext.quant.overlays.ple_quant import quantize_ple_table
from flashnext.quant.overlays.view import apply_overlays
from flashnext.quant.ple.source import find_ple_source
from flashnext.quant.checkpoint.snapshot import Snapshot
from support import SUPPORT_DIR, free_port, run_scenario

# the format's relative squared error on the demo's heavy-tailed table, with headroom
BOUNDS = {"nvfp4": 1.5e-2, "fp8": 1.5e-3}


@pytest.fixture(scope="module")
def built(demo_snapshot, tmp_path_factory):
    root = tmp_path_factory.mktemp("ple-quant")
    out = {}
    for fmt in ("nvfp4", "fp8"):
        report = quantize_ple_table(demo_snapshot, root / fmt, fmt)
        view = root / f"view-{fmt}"
        apply_overlays(demo_snapshot, [root / fmt], view)
        out[fmt] = (report, root / fmt, view)
    return out


def tensors(path, prefix: str) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        if name.startswith(prefix):
            with safe_open(str(path / shard), "pt") as f:
                out[name[len(prefix):]] = f.get_tensor(name)
    return out


def decoded_rows(snapshot, view, fmt: str, ids: torch.Tensor) -> torch.Tensor:
    """flashnext's decoder over the view's tensors for ``ids`` (the layout: the BF16 snapshot's)."""
    source = find_ple_source(Snapshot.open(snapshot))
    t = tensors(view, f"{source.prefix}.ngram_embedding.")
    shards = [s.index for s in source.shards]
    firsts = [s.first_row for s in source.shards]
    out = []
    for i in ids.tolist():
        k = max(j for j, first in enumerate(firsts) if first <= i)
        r = i - firsts[k]
        if fmt == "nvfp4":
            out.append(float_rows.nvfp4_decode(t[f"shard_{shards[k]}.weight"][r:r + 1],
                                               t[f"shard_{shards[k]}.weight_scale"][r:r + 1],
                                               float(t["weight_scale_2"][0])))
        else:
            out.append(float_rows.fp8_decode(t[f"shard_{shards[k]}.weight"][r:r + 1], float(t["weight_scale"][0])))
    return torch.cat(out)


def bf16_rows(snapshot, ids: torch.Tensor) -> torch.Tensor:
    source = find_ple_source(Snapshot.open(snapshot))
    t = tensors(snapshot, f"{source.prefix}.ngram_embedding.")
    table = torch.cat([t[f"shard_{s.index}.weight"] for s in source.shards])
    return table[ids]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_vllms_own_method_reads_the_overlay(fmt, built, demo_snapshot):
    report, _, view = built[fmt]
    rows = find_ple_source(Snapshot.open(demo_snapshot)).layout.padded_rows
    ids = torch.randint(0, rows, (64,), generator=torch.Generator().manual_seed(29))
    ids[:2] = torch.tensor([0, rows - 1])
    script = (SUPPORT_DIR / "ple_quantized_scenario.py").read_text()
    got = run_scenario(script, (str(view), free_port(), ",".join(map(str, ids.tolist()))),
                       extra_env={"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"})
    assert got["method"] == {"nvfp4": "Qwen4ExpPLENvFp4EmbeddingMethod", "fp8": "Qwen4ExpPLEFp8EmbeddingMethod"}[fmt]
    vllm_rows = torch.tensor(got["rows"])
    ours = decoded_rows(demo_snapshot, view, fmt, ids)
    assert torch.equal(vllm_rows, ours.float())  # bit for bit: the same formula, rounded where vLLM rounds
    reference = bf16_rows(demo_snapshot, ids).float()
    relative = float(((vllm_rows - reference) ** 2).sum() / (reference ** 2).sum())
    assert relative < BOUNDS[fmt], relative
    assert report["tables"][0]["relative_mse"] < BOUNDS[fmt]
    # what vLLM's method asked the embedding to allocate (patch host-pool pins exactly that much) is
    # what the preflight counts for this table, tensor for tensor: from the view, and from the overlay
    # stacked over the snapshot in memory (what `serve --overlay` plans from, no view written)
    from flashnext.quant.overlays.ple_quant import quantized_table_allocations
    from flashnext.quant.overlays.view import OverlayStack

    assert sorted(got["allocated"]) == sorted(quantized_table_allocations(Snapshot.open(view)))
    stacked = OverlayStack(demo_snapshot, [built[fmt][1]]).served
    assert sorted(got["allocated"]) == sorted(quantized_table_allocations(stacked))


def test_the_overlay_is_an_overlay_like_any_other(built, demo_snapshot):
    from flashnext.quant.overlays.view import verify_overlay

    for fmt, (report, overlay, view) in built.items():
        config = json.loads((view / "config.json").read_text())
        assert config["text_config"]["ple_embedding_dtype"] == float_rows.FORMATS[fmt]
        assert verify_overlay(demo_snapshot, overlay) == []
    comparison = built["nvfp4"][0]["tables"][0]["absmax_comparison"]
    assert comparison["rows"] > 0 and comparison["searched"] < comparison["absmax"]  # the block search pays


def test_the_block_search_is_never_worse_than_absmax_in_any_block():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(512, 64, generator=g) * torch.rand(512, 1, generator=g) ** 4).to(torch.bfloat16)
    x[::5, 7] *= 40  # outliers
    gs = float_rows.nvfp4_global_scale(float(x.float().abs().max()))

    def block_errors(search):
        d = float_rows.nvfp4_decode(*float_rows.nvfp4_encode(x, gs, search=search), gs, torch.float32)
        return ((d - x.float()) ** 2).reshape(512, 4, 16).sum(dim=2)

    searched, plain = block_errors(True), block_errors(False)
    assert (searched <= plain * (1 + 1e-6)).all() and searched.sum() < plain.sum()


def test_refusals(built, demo_snapshot, tmp_path):
    _, _, view = built["fp8"]
    with pytest.raises(FlashnextError, match="ple_embedding_dtype|BF16"):
        quantize_ple_table(view, tmp_path / "again", "nvfp4")  # a table already quantized
    with pytest.raises(FlashnextError, match="exists"):
        quantize_ple_table(demo_snapshot, built["nvfp4"][1], "nvfp4")
    assert not (tmp_path / "again").exists()


def test_the_command(demo_snapshot, tmp_path):
    from flashnext.tools.cli import main as cli

    result = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(tmp_path / "o"),
                                      "--format", "nvfp4", "--no-progress", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["format"] == "nvfp4" and report["tables"][0]["rows"] > 0
    bad = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(tmp_path / "p"),
                                   "--format", "int4"])
    assert bad.exit_code == 2
    for args, code in ((["--format", "nvfp4", "--device", "tpu"], 1), (["--device", "cuda"], 2)):
        refused = CliRunner().invoke(cli, ["ple", "build", "--src", str(demo_snapshot), "--out", str(tmp_path / "q"),
                                           *args])
        assert refused.exit_code == code, refused.output
    assert not (tmp_path / "q").exists()


def test_bad_inputs_are_one_line_and_write_nothing(snapshot_copy, tmp_path):
    """The builders' guards hold for this one too: an --out inside the source, or the source itself,
    is one line and exit 1, and the snapshot is left byte for byte as it was."""
    from flashnext.tools.cli import main as cli
    from support.hostile import tree_state

    before = tree_state(snapshot_copy)
    for out in (snapshot_copy / "ple-nvfp4", snapshot_copy):
        result = CliRunner().invoke(cli, ["ple", "build", "--src", str(snapshot_copy), "--out", str(out),
                                          "--format", "nvfp4", "--no-progress"])
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert tree_state(snapshot_copy) == before

