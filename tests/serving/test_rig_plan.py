"""Issue 30: `flashnext plan --gpus N` fits the seed's system to a rig, the shipped rig profiles are
what it writes, every profile goes through vLLM 0.34.0's parser and grouping, and the GLM profiles
hold to vLLM 0.34.0's own config classes."""

import dataclasses
import json
import os
import re

import jsonschema
import pytest
from click.testing import CliRunner

from flashnext.serving import capacity
from flashnext.serving.capacity import rig as rigs
from flashnext.serving.compose import render_compose, vllm_command
from flashnext.serving.deployment import Deployment
from flashnext.serving.profiles import available, load_profile, profile_text
from flashnext.tools.cli import main as cli

from support import ROOT

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="vLLM 0.34.0 is installed by .ci/run")

GIB = 2**30
SCHEMA = json.loads((ROOT / "manifests" / "compose-spec.schema.json").read_text())
QWEN = [name for name in available() if load_profile(name).model_family == "qwen4_exp"]
GLM = [name for name in available() if load_profile(name).model_family == "glm_moe_dsa"]


def reference(gpus: int, mtp: bool, host: float = 125, **kw) -> rigs.RigPlan:
    return rigs.plan_rig(rigs.Rig(gpus, 24 * GIB, int(host * GIB), mtp, **kw))


def arg(profile, flag: str) -> str:
    return profile.vllm_args[profile.vllm_args.index(flag) + 1]


# --- the rules reproduce the seed's own choices on its rig -----------------------------------------

@pytest.mark.parametrize("mtp, name, partition, seqs, blocks", [
    (False, "3x3090", [16, 16, 16], 4, 244), (True, "3x3090-mtp", [16, 17, 15], 2, 170)])
def test_the_reference_rig_gets_the_seeds_choices(mtp, name, partition, seqs, blocks):
    """Seed 000 §7/§10: 16/17/15 with MTP, 4 x 61 blocks (783,000,000 B) and 2 x 85 (550,000,000 B):
    the planner's rules give the shipped 3x3090 profiles' choices."""
    planned, shipped = reference(3, mtp), load_profile(name)
    assert planned.fits and planned.partition == partition and planned.max_num_seqs == seqs
    assert planned.plan.blocks == blocks == capacity.plan_profile(shipped).blocks
    assert str(seqs) == arg(shipped, "--max-num-seqs")
    assert planned.even_split == ("VLLM_PP_LAYER_PARTITION" not in shipped.env)
    if not planned.even_split:
        assert shipped.env["VLLM_PP_LAYER_PARTITION"] == ",".join(map(str, partition))
    # the generated profile differs from the seed's only in the KV bytes' rounding (783,000,000)
    generated = rigs.rig_profile(planned, name)
    assert capacity.plan_profile(generated).blocks == blocks
    differ = [a for a, b in zip(generated.vllm_args, shipped.vllm_args) if a != b]
    assert differ == [str(planned.kv_cache_memory_bytes)] and generated.env == shipped.env


def test_the_runtime_memory_is_the_seeds_peaks_less_what_the_plan_counts():
    """RUNTIME_BYTES: seed 000 §3.5's peaks at 783,000,000 B, text only, before mem-01."""
    p = capacity.plan_profile(dataclasses.replace(load_profile("3x3090"), vllm_args=[
        *load_profile("3x3090").vllm_args, "--language-model-only"]))
    peaks, weights = [24_022, 24_090, 24_038], [21.58, 21.55, 21.55]
    runtime = [peak * 2**20 - w * GIB - kv - arena
               for peak, w, kv, arena in zip(peaks, weights, p.vram_bytes, p.qsa_arena_bytes)]
    assert round(max(runtime) / 2**20) == rigs.RUNTIME_BYTES // 2**20
    # and the shipped 3x3090 profiles then fit a 3090 on every rank, with what the seed added since
    for mtp in (False, True):
        assert all(m.total <= rigs.Rig(3, 24 * GIB, 125 * GIB).usable_vram_bytes for m in reference(3, mtp).ranks)


# --- the shipped rig profiles are what plan writes, and plan says why 2x3090 is not one ------------

@pytest.mark.parametrize("name, flags", [("4x3090", []), ("4x3090-mtp", ["--mtp"])])
def test_the_shipped_4x3090_profiles_are_what_plan_writes(name, flags, tmp_path):
    out = tmp_path / f"{name}.json"
    r = CliRunner().invoke(cli, ["plan", "--gpus", "4", "--gpu-memory", "24", "--host-ram", "125", *flags,
                                 "--write-profile", str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert out.read_text() == (ROOT / "serving" / "profiles" / f"{name}.json").read_text()
    planned = json.loads(r.stdout)
    assert planned["fits"] and planned["profile_written"] == str(out)
    p = capacity.plan_profile(load_profile(name))
    # the KV memory holds --max-num-seqs full-context requests, exactly
    assert p.blocks == planned["max_num_seqs"] * p.blocks_per_request == planned["plan"]["blocks"]
    assert p.capacity_tokens == planned["max_num_seqs"] * 262_144


def test_two_3090s_cannot_hold_the_weights_and_plan_says_so_in_numbers(tmp_path):
    out = tmp_path / "2x3090.json"
    r = CliRunner().invoke(cli, ["plan", "--gpus", "2", "--gpu-memory", "24", "--host-ram", "128", "--ple-format",
                                 "nvfp4", "--json"])
    # the plan is printed, and the exit status says it does not fit (issue 41: it was 0)
    assert r.exit_code == 1, r.output
    planned = json.loads(r.stdout)
    assert r.stderr.strip() == (f"Error: the rig does not fit: {planned['reasons'][0]} "
                                "(and 1 more reason(s) in the plan)")
    assert not planned["fits"] and planned["max_num_seqs"] == 0 and planned["fewest_gpus_that_fit"] == 3
    # the plan beside it is one request's, and says so (issue 41: it was paired with max_num_seqs 0 silently)
    assert planned["plan"]["num_seqs"] == 1 and planned["plan"]["blocks"] == planned["plan"]["blocks_per_request"]
    assert planned["host"]["fits"]  # the host is not the problem: nvfp4 PLE + QSA K/V fit 128 GiB
    assert all(m["weights"] > planned["usable_vram_bytes"] for m in planned["ranks"])
    assert re.match(r"rank 0 needs 33\.\d\d GiB: weights 31\.\d\d GiB \(24 layers x 1\.28 GiB", planned["reasons"][0])
    text = CliRunner().invoke(cli, ["plan", "--gpus", "2", "--gpu-memory", "24", "--host-ram", "128"])
    assert "does NOT fit" in text.stdout and "the fewest GPUs of 24 GiB that fit: 3" in text.stdout
    assert text.exit_code == 1 and len(text.stderr.strip().splitlines()) == 1
    # no "--max-num-seqs 0" beside "1 x 108 blocks": not one request fits, and the numbers are one request's
    seqs = next(line for line in text.stdout.splitlines() if "--max-num-seqs" in line)
    assert "none: not one request fits" in seqs and " 0 " not in seqs, seqs
    kv = next(line for line in text.stdout.splitlines() if line.strip().startswith("--kv-cache-memory-bytes"))
    assert kv.endswith("(one request)"), kv
    refused = CliRunner().invoke(cli, ["plan", "--gpus", "2", "--gpu-memory", "24", "--host-ram", "128",
                                       "--write-profile", str(out)])
    assert refused.exit_code == 1 and len(refused.output.strip().splitlines()) == 1
    assert "no profile written" in refused.output
    assert not out.exists() and os.listdir(tmp_path) == []


def test_a_host_too_small_for_one_request_gets_the_largest_context_that_fits():
    planned = reference(4, False, host=16)  # one 262,144-token request pins 44 blocks x 3 x 4 x 31.6 MiB
    assert not planned.fits and planned.ranks and "host RAM" in planned.reasons[-1]
    largest = planned.largest_context_that_fits
    assert largest and largest % rigs.CONTEXT_STEP == 0 and largest < 262_144
    assert reference(4, False, host=16, context=largest).fits
    assert not reference(4, False, host=16, context=largest + rigs.CONTEXT_STEP).fits


# --- a written profile passes the shipped profiles' checks -----------------------------------------

def test_a_written_profile_passes_every_check_a_shipped_one_does(tmp_path):
    from vllm.entrypoints.common import cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm.envs
    from flashnext import envs

    out = tmp_path / "five-rig.json"
    r = CliRunner().invoke(cli, ["plan", "--gpus", "5", "--gpu-memory", "24", "--host-ram", "96", "--mtp",
                                 "--write-profile", str(out)])
    assert r.exit_code == 0 and "fits" in r.stdout, r.output
    profile = load_profile(str(out))
    assert profile.name == "five-rig" and profile.gpus == 5 and profile_text(profile) == out.read_text()
    parser = cli_args.make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(vllm_command(profile, "/models/view", "0.0.0.0", 8000)[2:])
    cli_args.validate_parsed_serve_args(args)
    assert args.pipeline_parallel_size == 5
    document = render_compose(Deployment(profile, tmp_path / "snap", (), tmp_path / "ple.bin"))
    jsonschema.validate(document, SCHEMA)
    service = document["services"]["vllm"]
    assert all(k in vllm.envs.environment_variables or k in {v.name for v in envs.ALL} or k in envs.THIRD_PARTY
               for k in service["environment"])
    # the container gets the file read-only and runs it from there
    mount = next(v for v in service["volumes"] if v["target"] == "/models/profile/five-rig.json")
    assert mount["source"] == str(out) and mount["read_only"]
    assert service["command"][service["command"].index("--profile") + 1] == "/models/profile/five-rig.json"
    (tmp_path / "snap").mkdir()
    (tmp_path / "ple.bin").write_bytes(b"")
    dry = CliRunner().invoke(cli, ["serve", "--profile", str(out), "--model", str(tmp_path / "snap"), "--ple-table",
                                   str(tmp_path / "ple.bin"), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    planned = CliRunner().invoke(cli, ["plan", "--profile", str(out), "--json"])
    assert json.loads(planned.stdout)["profile"] == "five-rig"


def test_write_profile_creates_a_new_file_only(tmp_path):
    plan = ["plan", "--gpus", "4", "--gpu-memory", "24", "--host-ram", "125", "--write-profile"]
    taken = tmp_path / "taken.json"
    taken.write_text("mine")
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")  # dangling: following it would create elsewhere.json
    for target, words in [(taken, "already exists"), (link, "already exists"), (tmp_path / "no-suffix", "NAME.json"),
                          (tmp_path / "missing" / "x.json", "not a directory"), (tmp_path / "a b.json", "NAME.json")]:
        r = CliRunner().invoke(cli, [*plan, str(target)])
        assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1 and words in r.output, (target, r.output)
    assert taken.read_text() == "mine" and not (tmp_path / "elsewhere.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["link.json", "taken.json"]  # no temporary left behind


@pytest.mark.parametrize("argv, code, words", [
    (["--gpus", "0", "--gpu-memory", "24", "--host-ram", "125"], 1, "--gpus must be at least 1"),
    (["--gpus", "4", "--gpu-memory", "-3", "--host-ram", "125"], 1, "--gpu-memory must be a positive"),
    (["--gpus", "4", "--gpu-memory", "24", "--host-ram", "nan"], 1, "--host-ram must be a positive"),
    (["--gpus", "4", "--gpu-memory", "24", "--host-ram", "125", "--context", "0"], 1, "--context must be at least"),
    (["--gpus", "49", "--gpu-memory", "24", "--host-ram", "125"], 1, "48 layers"),
    (["--gpus", "4", "--gpu-memory", "24"], 2, "--host-ram"),
    (["--gpus", "4", "--gpu-memory", "24", "--host-ram", "125", "--profile", "3x3090"], 2, "contradict"),
    (["--gpus", "4", "--gpu-memory", "24", "--host-ram", "125", "--kv-cache-memory-bytes", "5"], 2, "is for --profile"),
    (["--profile", "3x3090", "--mtp"], 2, "--mtp is for a rig plan"),
    ([], 2, "plan needs --profile"),
])
def test_bad_input_is_one_line(argv, code, words):
    r = CliRunner().invoke(cli, ["plan", *argv])
    assert r.exit_code == code and len(r.output.strip().splitlines()) == 1 and words in r.output, r.output


# --- every shipped profile through vLLM's parser and grouping --------------------------------------

@pytest.mark.parametrize("name", QWEN)
def test_every_qwen_profile_holds_its_sequences_and_sets_engram_offload(name):
    """vLLM's grouping gives each Qwen profile's KV memory --max-num-seqs full-length requests; and
    engram's cpu_offload is set in the profile, not left to vLLM's default (EngramConfig.cpu_offload,
    vllm/config/engram.py), which decides where a table without --ple-table goes."""
    from flashnext.serving.capacity.shape import engine_args

    profile = load_profile(name)
    p = capacity.plan_profile(profile)
    args = engine_args(profile)
    assert p.blocks >= args.max_num_seqs * p.blocks_per_request
    assert "--engram-config" in profile.vllm_args and args.engram_config is not None
    assert json.loads(arg(profile, "--engram-config")) == {"cpu_offload": True} and args.engram_config.cpu_offload


def test_the_hisparse_connector_alone_turns_hisparse_on():
    """vllm/config/vllm.py VllmConfig.__post_init__: with a HiSparseConnector and no
    attention_config.hisparse_config it sets HiSparseConfig(), so the profile leaves
    --attention-config out; the checks that follow then run (here: the CPU platform has no HiSparse
    backend). The baseline, without the connector, is left alone."""
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import hisparse_host_pool_gib

    from flashnext.serving.capacity.shape import engine_args

    hisparse = engine_args(load_profile("8xh200-glm53-hisparse"))
    assert hisparse.attention_config.hisparse_config is None  # nothing from the command line
    assert hisparse_host_pool_gib(hisparse.kv_transfer_config) == 384
    # vLLM 0.34.0 asks the platform for a HiSparse backend (Platform.get_hisparse_backend_cls)
    # where 0.33.0 required CUDA by name ("HiSparse currently requires NVIDIA CUDA").
    with pytest.raises(Exception, match="The current platform does not support HiSparse"):
        VllmConfig(kv_transfer_config=hisparse.kv_transfer_config)
    baseline = engine_args(load_profile("8xh200-glm53-offload"))
    assert hisparse_host_pool_gib(baseline.kv_transfer_config) is None
    assert VllmConfig(kv_transfer_config=baseline.kv_transfer_config).attention_config.hisparse_config is None


@pytest.mark.parametrize("name", GLM)
def test_the_glm_profiles_differ_in_the_kv_connector_only(name):
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from flashnext.serving.capacity.shape import engine_args

    hisparse, other = load_profile("8xh200-glm53-hisparse"), load_profile(name)
    flag = "--kv-transfer-config"
    assert [a for a in other.vllm_args if a != arg(other, flag)] == [
        a for a in hisparse.vllm_args if a != arg(hisparse, flag)]
    assert (other.env, other.container, other.gpus) == (hisparse.env, hisparse.container, hisparse.gpus)
    config = engine_args(other).kv_transfer_config
    offload = [c for c in config.kv_connector_extra_config.get("connectors", [vars(config)])
               if c["kv_connector"] == "OffloadingConnector"]
    spec = offload[0]["kv_connector_extra_config"]
    assert spec["spec_name"] in OffloadingSpecFactory._registry
    assert spec["cpu_bytes_to_use"] == (128 if name == "8xh200-glm53-hisparse" else 512) * GIB  # seed 004


def test_the_hisparse_host_pool_is_one_per_engine_shared_by_its_tp_ranks(monkeypatch):
    """vllm/v1/hisparse/runtime.py use_shared_hisparse_host_pool: one mmap for all TP ranks when
    TP > 1, PP = 1, one node and the mp executor (the profile sets it); otherwise each rank's
    HiSparseHostPool.allocate pins host_pool_gib of its own. A DP replica is an engine of its own
    (its own instance id, get_hisparse_host_pool), so each pins host_pool_gib."""
    import types

    from vllm.config import ParallelConfig
    from vllm.v1.hisparse import backend, runtime

    from flashnext.serving.capacity.shape import engine_args

    args = engine_args(load_profile("8xh200-glm53-hisparse"))
    # vLLM 0.34.0 asks the platform's HiSparse backend whether TP ranks can share a host pool
    # (CUDAHiSparseBackend.supports_shared_host_pool); 0.33.0 asked is_cuda_alike(). The CUDA
    # platform (vllm/platforms/cuda.py, which needs libcuda to import) names this backend.
    monkeypatch.setattr(backend, "current_platform", types.SimpleNamespace(
        get_hisparse_backend_cls=lambda: "vllm.v1.hisparse.backend.CUDAHiSparseBackend"))

    def shared(**kw) -> bool:
        return runtime.use_shared_hisparse_host_pool(types.SimpleNamespace(parallel_config=ParallelConfig(**kw)))

    profile_parallel = dict(tensor_parallel_size=args.tensor_parallel_size,
                            distributed_executor_backend=args.distributed_executor_backend)
    assert profile_parallel == {"tensor_parallel_size": 8, "distributed_executor_backend": "mp"}
    assert shared(**profile_parallel)
    assert shared(**profile_parallel, data_parallel_size=2)  # per replica
    assert not shared(tensor_parallel_size=8, distributed_executor_backend="uni")
    assert not shared(tensor_parallel_size=1)


def test_the_docs_list_every_profile():
    """docs/serving.md's profile table and the README's serve line list exactly the shipped profiles."""
    serving = (ROOT / "docs" / "serving.md").read_text()
    table = serving[serving.index("| profile | what"):serving.index("\n\n", serving.index("| profile | what"))]
    assert re.findall(r"^\| `([^`]+)` \|", table, re.M) == available()
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"serving\s+profiles \(([^)]*)\)", readme).group(1)
    assert re.findall(r"`([^`]+)`", line) == available()
