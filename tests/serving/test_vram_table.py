"""Issue 41 item 9: `flashnext plan` leads with one table, a row per rank, that a user reads at a
glance (serving/capacity/vram.py): weights + KV cache + runtime + flashnext = total, against the card,
and what is free. Its columns add up, it prints no raw byte counts, a snapshot's weights are its own
tensors, and on the seed's rig it gives back the seed's own free memory."""

import dataclasses
import json
import re
import shutil

import pytest
from click.testing import CliRunner

from flashnext.errors import FlashnextError
from flashnext.serving import capacity
from flashnext.serving.capacity import rig as rigs
from flashnext.serving.capacity import vram
from flashnext.serving.capacity.ledger import PROFILED_PEAK, profile_ledger
from flashnext.serving.profiles import load_profile
from flashnext.tools.cli import main as cli

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.34.0 is installed by .ci/run")

GIB, MIB = 2**30, 2**20
PARTS = ("weights", "kv_cache", "runtime", "flashnext")


def plan_json(*argv: str, code: int = 0) -> dict:
    r = CliRunner().invoke(cli, ["plan", *argv, "--json"])
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def table_lines(stdout: str) -> list[str]:
    """The table as printed: its heading, its head row and its rows (up to the first legend line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("VRAM per GPU at its peak"))
    end = next(i for i in range(start + 2, len(lines)) if not re.match(r"\s+(\d+|all)\s", lines[i]))
    return lines[start:end]


def check_adds_up(table: dict) -> None:
    rows = table["ranks"]
    for row in rows:
        assert row["total_bytes"] == sum(row[f"{c}_bytes"] for c in PARTS)
        if table["card_bytes"] is not None:
            assert row["card_bytes"] == table["card_bytes"] == table["gpu_memory_bytes"] - vram.DEVICE_RESERVED_BYTES
            assert row["free_bytes"] == row["card_bytes"] - row["total_bytes"]
    for column in (*PARTS, "total", "card", "free"):
        values = [row[f"{column}_bytes"] for row in rows]
        assert table["all"][f"{column}_bytes"] == (None if None in values else sum(values))
    assert table["fits"] == (None if table["card_bytes"] is None else all(r["free_bytes"] >= 0 for r in rows))


# --- the columns add up, in the JSON and as printed ------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["--profile", "3x3090"], ["--profile", "3x3090-mtp"], ["--profile", "4x3090-mtp"],
    ["--gpus", "3", "--gpu-memory", "24", "--host-ram", "125", "--mtp"]])
def test_the_columns_add_up(argv):
    out = plan_json(*argv)
    table = out["vram"]
    check_adds_up(table)
    assert [r["layers"] for r in table["ranks"]] == (out["plan"] if "plan" in out else out)["layers_per_rank"]
    assert [r["kv_cache_bytes"] for r in table["ranks"]] == (out["plan"] if "plan" in out else out)["vram_bytes"]
    assert table["fits"] and table["weights_from"] == vram.SEED_WEIGHTS
    text = CliRunner().invoke(cli, ["plan", *argv])
    assert text.exit_code == 0, text.output
    shown = table_lines(text.stdout)
    heads = shown[1].split()
    assert heads == ["rank", "layers", "weights", "KV", "cache", "runtime", "flashnext", "total", "card", "free"]
    for line, row in zip(shown[2:], [*table["ranks"], table["all"]]):
        cells = [float(cell.replace(",", "")) for cell in line.split()[2:]]
        assert cells == [round(row[f"{c}_bytes"] / MIB, 2) for c in vram.COLUMNS], line
        weights, kv, runtime, own, total, card, free = cells
        assert abs(weights + kv + runtime + own - total) < 0.03 and abs(card - total - free) < 0.02


@pytest.mark.parametrize("argv", [
    ["--profile", "3x3090"], ["--profile", "3x3090-mtp", "--host-ram", "125"],
    ["--gpus", "3", "--gpu-memory", "24", "--host-ram", "125", "--mtp"]])
def test_the_human_output_has_no_raw_byte_counts(argv):
    r = CliRunner().invoke(cli, ["plan", *argv])
    assert r.exit_code == 0, r.output
    for line in table_lines(r.stdout):
        assert not re.search(r"\d{7}|\d{1,3}(,\d{3}){2,}(?!\.\d)", line), line  # a count of bytes, not MiB.xx
    # nor anywhere else, but for --kv-cache-memory-bytes' own value (what one types)
    for line in r.stdout.splitlines():
        rest = re.sub(r"--kv-cache-memory-bytes [\d,]+", "", line)
        assert not re.search(r"\d{1,3}(,\d{3}){2,} B\b|\d{7,} B\b", rest), line
    # the lines the table replaced are gone
    assert not re.search(r"VRAM (per rank|with images|in all)", r.stdout)


# --- what each column holds ---------------------------------------------------------------------------

def test_the_columns_are_the_ledgers_entries_and_the_seeds_measurements():
    profile = load_profile("3x3090-mtp")
    plan = capacity.plan_profile(profile)
    ledger = profile_ledger(profile, plan)
    table = vram.profile_vram(profile, plan, ledger, 24 * GIB)
    tower = next(e for e in ledger.ranks[0].entries if e.name == "vision tower (resident)")
    assert [r.weights for r in table.ranks] == [
        16 * vram.LAYER_WEIGHT_BYTES + vram.FIRST_RANK_WEIGHT_BYTES + tower.gpu_peak,
        17 * vram.LAYER_WEIGHT_BYTES,
        15 * vram.LAYER_WEIGHT_BYTES + vram.LAST_RANK_WEIGHT_BYTES + vram.DRAFT_WEIGHT_BYTES]
    assert [r.kv_cache for r in table.ranks] == plan.vram_bytes
    assert [r.runtime for r in table.ranks] == [vram.RUNTIME_BYTES + plan.vision.activation_bytes,
                                                vram.RUNTIME_BYTES, vram.RUNTIME_BYTES]
    for rank, row in zip(ledger.ranks, table.ranks):
        names = {e.name: e for e in rank.entries}
        # flashnext's own: the arena and its state, and the transients outside vLLM's numbers; not the
        # router rows (the checkpoint's router weights, in weights) nor the scratch within the arena,
        # nor a step's transients inside vLLM's profiled peak (the INT8 embedding's rows: the runtime's)
        own = sum(e.gpu_peak for e in rank.entries if not e.vllms and e.within is None and not e.checkpoint
                  and e.inside != PROFILED_PEAK)
        assert row.flashnext == own >= plan.qsa_arena_bytes[rank.rank]
        if rank.rank != 1:  # the target's INT8 embedding on rank 0, the draft's own on rank 2
            assert vram.column_of(names["INT8 embedding's rows"]) is None
        assert names["decode-05 router rows"].checkpoint and vram.column_of(names["decode-05 router rows"]) == "weights"
        assert vram.column_of(names["staged-prefill scratch"]) is None
    # the rig planner decides by the same rows
    planned = rigs.plan_rig(rigs.Rig(3, 24 * GIB, 125 * GIB, mtp=True))
    assert [m.total for m in planned.ranks] == [r.total for r in table.ranks] == [r.total for r in planned.table.ranks]


def test_the_card_comes_from_the_profile_or_gpu_memory(tmp_path):
    assert load_profile("3x3090").gpu_memory_gib == 24 and load_profile("8xh200-glm53-hisparse").gpu_memory_gib
    big = plan_json("--profile", "3x3090", "--gpu-memory", "48")["vram"]
    assert big["gpu_memory_bytes"] == 48 * GIB and big["card_bytes"] == 48 * GIB - vram.DEVICE_RESERVED_BYTES
    check_adds_up(big)
    # a profile without the field: the table without the card and what is free, and how to get them
    data = json.loads(load_profile("3x3090").path.read_text())
    del data["gpu_memory_gib"]
    (tmp_path / "nocard.json").write_text(json.dumps({**data, "name": "nocard"}))
    out = plan_json("--profile", str(tmp_path / "nocard.json"))["vram"]
    assert out["card_bytes"] is None and out["fits"] is None and all(r["free_bytes"] is None for r in out["ranks"])
    check_adds_up(out)
    text = CliRunner().invoke(cli, ["plan", "--profile", str(tmp_path / "nocard.json")])
    assert text.exit_code == 0 and "--gpu-memory GiB" in text.stdout
    assert table_lines(text.stdout)[1].split()[-1] == "total"
    # the range a profile's field has, for --gpu-memory too
    for bad in ("0.5", "nan", "2000"):
        r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--gpu-memory", bad])
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and "--gpu-memory must be" in r.output
    for bad in (0, 0.5, 2000, "24", True, None):
        (tmp_path / "3x3090.json").write_text(json.dumps({**data, "gpu_memory_gib": bad}))
        if bad is None:
            assert load_profile("3x3090", tmp_path).gpu_memory_gib is None
            continue
        with pytest.raises(FlashnextError, match="gpu_memory_gib"):
            load_profile("3x3090", tmp_path)


def test_a_profile_over_its_card_exits_1_with_its_plan_printed():
    r = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--kv-cache-memory-bytes", "2000000000", "--json"])
    assert r.exit_code == 1
    table = json.loads(r.stdout)["vram"]
    assert table["fits"] is False
    assert re.match(r"Error: profile 3x3090 does not fit: rank \d needs [\d.]+ GiB of the 23\.56 GiB", r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1


# --- a snapshot's weights are its own tensors -------------------------------------------------------

def _tensors(snapshot) -> dict[str, int]:
    from flashnext.quant.checkpoint.snapshot import Snapshot

    snap = Snapshot.open(snapshot)
    return {name: snap.entry(name)[1].nbytes for name in snap.weight_map}


@pytest.mark.parametrize("name", ["3x3090", "3x3090-mtp"])
def test_the_weights_of_a_snapshot_are_its_tensors(name, demo_snapshot, tmp_path):
    """With --model the weights column is the snapshot's tensors as its headers size them: in all,
    every tensor the served model loads (all but the PLE table, which the profiles serve from a file,
    and the MTP head where the profile serves no draft); per rank, as vLLM places them."""
    data = json.loads(load_profile(name).path.read_text())
    data["env"].pop("VLLM_PP_LAYER_PARTITION", None)  # the release's 16/17/15: the demo has 4 layers
    (tmp_path / "demo-rig.json").write_text(json.dumps({**data, "name": "demo-rig"}))
    out = plan_json("--profile", str(tmp_path / "demo-rig.json"), "--model", str(demo_snapshot))
    table = out["vram"]
    check_adds_up(table)
    tensors = _tensors(demo_snapshot)
    mtp = name.endswith("-mtp")
    loaded = {n: b for n, b in tensors.items()
              if ".ple_embedding.ngram_embedding." not in n and (mtp or not n.startswith("mtp."))}
    assert table["all"]["weights_bytes"] == sum(loaded.values())
    assert 0 < sum(loaded.values()) < sum(tensors.values())
    ranks = capacity.rank_layers(4, 3, None)
    expected = [sum(b for n, b in loaded.items() if any(f"layers.{i}." in n and not n.startswith("mtp.") for i in r))
                for r in ranks]
    expected[0] += sum(b for n, b in loaded.items() if "embed_tokens." in n or n.startswith("model.visual."))
    expected[-1] += sum(b for n, b in loaded.items() if n.startswith(("lm_head.", "mtp.", "model.language_model.norm.",
                                                                       "model.language_model.hyper_connection_mixer.")))
    assert [r["weights_bytes"] for r in table["ranks"]] == expected
    assert table["notes"] == [] and str(demo_snapshot) in table["weights_from"]


def test_a_tensor_the_plan_cannot_place_is_named_not_guessed(demo_snapshot, snapshot_copy):
    import torch
    from safetensors.torch import save_file

    save_file({"model.language_model.something_new.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
               "model.language_model.layers.9.mlp.gate.weight": torch.zeros(2, 4, dtype=torch.bfloat16)},
              str(snapshot_copy / "extra.safetensors"))
    index = json.loads((snapshot_copy / "model.safetensors.index.json").read_text())
    index["weight_map"].update({"model.language_model.something_new.weight": "extra.safetensors",
                                "model.language_model.layers.9.mlp.gate.weight": "extra.safetensors"})
    (snapshot_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    base = plan_json("--profile", "3x3090", "--model", str(demo_snapshot))["vram"]
    out = plan_json("--profile", "3x3090", "--model", str(snapshot_copy))["vram"]
    assert out["all"]["weights_bytes"] == base["all"]["weights_bytes"]  # not counted ...
    assert len(out["notes"]) == 1 and "2 tensor(s)" in out["notes"][0] and "48 B" in out["notes"][0]  # ... but said
    assert "model.language_model.something_new.weight" in out["notes"][0]


def test_a_config_without_its_snapshot_has_no_weights(demo_snapshot, tmp_path):
    shutil.copy(demo_snapshot / "config.json", tmp_path / "config.json")
    out = plan_json("--profile", "3x3090", "--model", str(tmp_path / "config.json"))["vram"]
    assert all(r["weights_bytes"] is None and r["total_bytes"] is None for r in out["ranks"]) and out["fits"] is None
    assert len(out["notes"]) == 1 and "model.safetensors.index.json" in out["notes"][0]
    text = CliRunner().invoke(cli, ["plan", "--profile", "3x3090", "--model", str(tmp_path / "config.json")])
    assert text.exit_code == 0 and "note: weights: " in text.stdout


# --- the seed's rig -------------------------------------------------------------------------------

SEED_PEAKS_MIB = [24_022, 24_090, 24_038]  # seed 000 §3.5: 4 x 247k tokens held at 783,000,000 B, text only
SEED_WEIGHTS_GIB = [21.58, 21.55, 21.55]  # the weights then, before mem-01 (§6)
CARD_MIB = 24_124  # a 3090's usable memory (§3.5)


def test_the_3x3090_profile_gives_back_the_seeds_free_memory():
    """The 3x3090 profile (the seed's release configuration, §10) as seed 000 §3.5 measured it, text
    only and with the weights of then: the table's totals are the seed's peaks, never under and at most
    the runtime's spread over (the runtime is the fullest rank's, 99 MiB above rank 0's), and the
    fullest card has the seed's tens of MiB free. Since mem-01 (vLLM 0.34.0's own) that rank has its
    1.11 GiB more."""
    profile = load_profile("3x3090")
    text_only = dataclasses.replace(profile, vllm_args=[*profile.vllm_args, "--language-model-only"])
    plan = capacity.plan_profile(text_only)
    table = vram.vram_table(profile_ledger(text_only, plan), plan.layers_per_rank,
                            [round(w * GIB) for w in SEED_WEIGHTS_GIB], 24 * GIB, "seed 000 §3.5")
    assert table.card_bytes == CARD_MIB * MIB
    for row, peak in zip(table.ranks, SEED_PEAKS_MIB):
        assert 0 <= row.total - peak * MIB <= 110 * MIB, (row, peak)
    # the seed's fullest card, whose runtime the table takes for every rank: its tens of MiB free (34 then)
    fullest = table.ranks[1]
    assert 10 * MIB < fullest.free <= (CARD_MIB - SEED_PEAKS_MIB[1]) * MIB
    # today's release: every rank fits, rank 1 with mem-01's 1.11 GiB more
    release = plan_json("--profile", "3x3090")["vram"]
    assert release["fits"]
    assert release["ranks"][1]["free_bytes"] - fullest.free == round(SEED_WEIGHTS_GIB[1] * GIB) - 16 * vram.LAYER_WEIGHT_BYTES


def test_the_3x3090_mtp_profile_has_the_seeds_tens_of_mib_free():
    """Seed 000 §7's release (the MTP head on the third card, 16/17/15, 550,000,000 B): the fullest
    card keeps tens of MiB, the order of the seed's 24-34 MiB (§5, §7)."""
    table = plan_json("--profile", "3x3090-mtp")["vram"]
    free = [r["free_bytes"] for r in table["ranks"]]
    assert free.index(min(free)) == 1 and 10 * MIB < min(free) < 100 * MIB


def test_the_docs_show_what_plan_prints():
    """docs/serving.md's example of `plan --profile` is its output, table and legend included."""
    from support import ROOT

    doc = (ROOT / "docs" / "serving.md").read_text()
    command = "flashnext plan --profile 3x3090 --kv-cache-memory-bytes 550000000 --no-prefix-caching"
    shown = re.search(rf"```\n\$ {re.escape(command)}\n(.*?)```", doc, re.S)
    assert shown, f"docs/serving.md shows no output of {command}"
    r = CliRunner().invoke(cli, command.split()[1:])
    assert r.exit_code == 0 and shown.group(1) == r.stdout
