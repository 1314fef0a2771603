"""Fitting the ``qwen4_exp`` serving system to a rig of equal GPUs: ``flashnext plan --gpus N``.

The system is the seed's (000): pipeline parallelism, the QSA K/V in pinned host memory, the PLE
table on NVMe (or pinned in a quantized format), images through vit-stream, optionally the MTP
head with one draft token. What changes with the rig is decided here, by these rules:

- **Layer partition:** each decoder layer goes, one at a time, to the rank whose memory would be
  lowest with it (water-filling), beside each rank's fixed load: the embedding and the vision
  tower on the first, the LM head and the MTP draft on the last. Seed 000 §7 chose 16/17/15 for
  MTP on three cards by hand; the rule gives the same.
- **Sequences and KV memory:** ``--max-num-seqs`` is the largest n for which n full-context
  requests' blocks fit every rank's VRAM and the host's RAM, and the KV memory is exactly those
  n x R blocks (R: one request's blocks, from vLLM's grouping, :mod:`.qwen4_exp`). n is at most the
  largest CUDA-graph capture size over the tokens a sequence takes a step (1 + draft tokens):
  the fused decode kernels and the graphs cover 4 tokens, and seed 000 §9 measured 8 sequences
  slower than 4. On the reference rig this gives the seed's own choices: 4 x 61 = 244 blocks
  (783,000,000 B) and, with MTP, 2 x 85 = 170 (550,000,000 B).
- **VRAM per rank:** the rank's row of ``plan``'s VRAM table (:mod:`.vram`): weights + KV cache +
  runtime + flashnext's own, against the GPU's memory less what the driver keeps.

The weights and the runtime's memory are seed 000's measurements of the release checkpoint
(:mod:`.vram`); a rig plan is for that checkpoint, not for ``--model``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

from flashnext.errors import FlashnextError
from flashnext.serving.capacity.kv import rank_layers
from flashnext.serving.capacity.ledger import PLE_FORMATS
from flashnext.serving.capacity.model import load_text_config, load_vision_config
from flashnext.serving.capacity.qwen4_exp import Plan, plan_profile
from flashnext.serving.capacity.shape import PP_LAYER_PARTITION, ServingShape, engine_args
from flashnext.serving.capacity.vision import vision_plan
from flashnext.serving.capacity.vram import (LAYER_WEIGHT_BYTES, RUNTIME_BYTES, SEED_WEIGHTS, VramTable, base_weights,
                                             check_gpu_memory, seed_weights, usable_bytes, vram_table)

GIB = 1 << 30

# The profiles a rig's profile is made from: the seed's system, without and with MTP. Only the
# rig's own settings (RIG_ARGS, the partition, the PLE table's home) differ from these.
TEMPLATES = {False: "3x3090", True: "3x3090-mtp"}
RIG_ARGS = ("--pipeline-parallel-size", "--max-model-len", "--max-num-seqs", "--kv-cache-memory-bytes")


@dataclass(frozen=True)
class Rig:
    gpus: int
    gpu_memory_bytes: int
    host_ram_bytes: int
    mtp: bool = False
    context: int = 262_144
    ple_format: str = "file"

    def __post_init__(self):
        if self.gpus < 1:
            raise FlashnextError(f"must be at least 1, got {self.gpus}", field="gpus")
        check_gpu_memory(self.gpu_memory_bytes / GIB, "gpu_memory")  # a profile's gpu_memory_gib holds it
        if self.host_ram_bytes <= 0:
            raise FlashnextError(f"must be positive, got {self.host_ram_bytes / GIB:g}", field="host_ram")
        if self.context < 1:
            raise FlashnextError(f"must be at least 1 token, got {self.context}", field="context")
        if self.ple_format not in PLE_FORMATS:
            raise FlashnextError(f"must be one of {', '.join(PLE_FORMATS)}, got {self.ple_format!r}", field="ple_format")

    @property
    def usable_vram_bytes(self) -> int:
        return usable_bytes(self.gpu_memory_bytes)


@dataclass
class RankMemory:
    """One rank's device memory at its peak, in bytes: some of its parts, and its total, the
    rank's row of the VRAM table (``RigPlan.table``)."""

    layers: int
    weights: int  # decoder layers + the first/last rank's extras + the MTP draft (the tower: ``vision``)
    kv_pool: int
    qsa_arena: int
    vision: int  # the tower's weights and its activations
    runtime: int  # the seed's measurement
    total: int  # the table's: weights + KV cache + runtime + flashnext's own
    flashnext: int = 0  # the table's flashnext column (the arena among it)


@dataclass
class RigPlan:
    rig: Rig
    fits: bool
    reasons: list[str]  # why it does not fit, in numbers (empty when it fits)
    partition: list[int]
    even_split: bool  # the partition is vLLM's own (no VLLM_PP_LAYER_PARTITION)
    max_num_seqs: int  # 0: not even one request fits
    max_num_seqs_limit: int  # the capture sizes' bound
    kv_cache_memory_bytes: int
    usable_vram_bytes: int
    ranks: list[RankMemory]
    host: dict  # the pinned host terms and whether they fit (plan --host-ram's)
    plan: Plan  # at max_num_seqs requests (at one when none fits)
    largest_context_that_fits: int | None = None  # when the asked context does not fit
    fewest_gpus_that_fit: int | None = None  # when these GPUs cannot hold the weights
    profile: object = field(default=None, repr=False)  # the Profile of this plan
    table: VramTable | None = field(default=None, repr=False)  # each rank's memory, as plan prints it

    @property
    def plan_num_seqs(self) -> int:
        """The requests ``plan`` is for: ``max_num_seqs``, or one where none fits."""
        return max(self.max_num_seqs, 1)

    def to_json(self) -> dict:
        data = {k: v for k, v in asdict(dataclasses.replace(self, plan=None, profile=None, table=None)).items()
                if k not in ("profile", "plan", "table")}
        data["plan"] = {**self.plan.to_json(), "num_seqs": self.plan_num_seqs}  # not max_num_seqs' 0
        data["vram"] = self.table.to_json() if self.table is not None else None
        return data


def _replace_arg(args: list[str], flag: str, value: str) -> list[str]:
    if flag not in args:
        raise FlashnextError(f"the template profile has no {flag} to set")  # a shipped profile was edited
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


def fixed_loads(rig: Rig, pp: int, vision_bytes: int) -> list[int]:
    """Each rank's device memory besides its decoder layers, KV pool and arena: the first rank's
    extras and the tower, the last rank's LM head and draft, the runtime on every rank."""
    loads = [RUNTIME_BYTES + w for w in seed_weights([0] * pp, rig.mtp)]
    loads[0] += vision_bytes
    return loads


def layer_partition(num_layers: int, loads: list[int]) -> list[int]:
    """Water-filling: each layer to the rank that would hold the least with it (ties: the earlier
    rank), so that the fullest rank is as empty as any partition can leave it."""
    counts = [0] * len(loads)
    for _ in range(num_layers):
        rank = min(range(len(loads)), key=lambda r: (loads[r] + (counts[r] + 1) * LAYER_WEIGHT_BYTES, r))
        counts[rank] += 1
    return counts


def max_seqs_limit(template, mtp_tokens: int) -> int:
    """The most sequences a decode step may hold: the largest CUDA-graph capture size of the
    template, over the tokens one sequence takes a step."""
    sizes = engine_args(template).compilation_config.cudagraph_capture_sizes or [1]
    return max(max(sizes) // (1 + mtp_tokens), 1)


def _profile(template, rig: Rig, partition: list[int], even: bool, seqs: int, kv_bytes: int, context: int):
    args = list(template.vllm_args)
    for flag, value in zip(RIG_ARGS, (rig.gpus, context, max(seqs, 1), max(kv_bytes, 1))):
        args = _replace_arg(args, flag, str(value))
    env = {k: v for k, v in template.env.items() if k != PP_LAYER_PARTITION}
    if not even:
        env[PP_LAYER_PARTITION] = ",".join(map(str, partition))
    return dataclasses.replace(template, gpus=rig.gpus, vllm_args=args, env=env,
                               uses_ple_table=rig.ple_format == "file", gpu_memory_gib=rig.gpu_memory_bytes / GIB)


def _memory(rig: Rig, profile, plan: Plan, partition: list[int]) -> tuple[list[RankMemory], VramTable]:
    """Each rank's memory: the VRAM table ``plan`` prints (:mod:`.vram`), from the profile's ledger."""
    from flashnext.serving.capacity.ledger import profile_ledger

    ledger = profile_ledger(profile, plan, ple_format=rig.ple_format)
    table = vram_table(ledger, partition, base_weights(partition, rig.mtp, ledger), rig.gpu_memory_bytes,
                       SEED_WEIGHTS)
    ranks = []
    for r, (layers, weights, row) in enumerate(zip(partition, seed_weights(partition, rig.mtp), table.ranks)):
        vision = plan.vram_bytes_total[r] - plan.vram_bytes[r] - plan.qsa_arena_bytes[r]
        ranks.append(RankMemory(layers, weights, plan.vram_bytes[r], plan.qsa_arena_bytes[r], vision, RUNTIME_BYTES,
                                row.total, row.flashnext))
    return ranks, table


def _host(profile, plan: Plan, rig: Rig) -> dict:
    from flashnext.serving import capacity
    from flashnext.serving.capacity.ledger import host_fit, pinned_host_terms

    shape = ServingShape.from_profile(profile)
    terms = pinned_host_terms(shape, plan, ple_format=rig.ple_format)
    fits, kv_fits = host_fit(shape, plan, terms, rig.host_ram_bytes)
    return {"host_bytes": rig.host_ram_bytes, "headroom_bytes": capacity.HOST_HEADROOM, "ple_format": rig.ple_format,
            "pinned": {t.name: t.bytes for t in terms}, "pinned_total_bytes": sum(t.bytes for t in terms),
            "fits": fits, "largest_kv_cache_memory_bytes_that_fits": kv_fits}


def _attempt(template, rig: Rig, partition, even, seqs: int, context: int):
    """The plan, memory and host of ``seqs`` full-context requests (their blocks exactly)."""
    probe = _profile(template, rig, partition, even, 1, 1, context)
    shape_plan = plan_profile(probe)  # 0 blocks: one request's blocks and a block's bytes
    kv_bytes = seqs * shape_plan.blocks_per_request * max(shape_plan.bytes_per_block)
    profile = _profile(template, rig, partition, even, seqs, kv_bytes, context)
    plan = plan_profile(profile)
    ranks, table = _memory(rig, profile, plan, partition)
    host = _host(profile, plan, rig)
    return profile, plan, ranks, host, kv_bytes, table


def _fits(rig: Rig, ranks: list[RankMemory], host: dict) -> bool:
    return all(m.total <= rig.usable_vram_bytes for m in ranks) and host["fits"]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _reasons(rig: Rig, table: VramTable, host: dict, plan: Plan, context: int) -> list[str]:
    """Why the rig does not fit, in the VRAM table's columns and the host's terms."""
    out = []
    last = len(table.ranks) - 1
    for r, row in enumerate(table.ranks):
        if row.free < 0:
            parts = (f"weights {_gib(row.weights)} ({row.layers} layers x {_gib(LAYER_WEIGHT_BYTES)}"
                     f"{' + embedding' if r == 0 else ''}{' + vision tower' if r == 0 and plan.vision else ''}"
                     f"{' + LM head' if r == last else ''}{' + MTP draft' if rig.mtp and r == last else ''})")
            out.append(f"rank {r} needs {_gib(row.total)}: {parts} + KV cache {_gib(row.kv_cache)} ({plan.blocks} "
                       f"blocks for one {context:,}-token request) + runtime {_gib(row.runtime)} + flashnext "
                       f"{_gib(row.flashnext)}; a {_gib(rig.gpu_memory_bytes)} GPU gives {_gib(row.card)}")
    if not host["fits"]:
        terms = " + ".join(f"{name} {_gib(n)}" for name, n in host["pinned"].items())
        out.append(f"pinned host memory {terms} + {_gib(host['headroom_bytes'])} headroom = "
                   f"{_gib(host['pinned_total_bytes'] + host['headroom_bytes'])} > {_gib(rig.host_ram_bytes)} host RAM")
    return out


def plan_rig(rig: Rig, search: bool = True) -> RigPlan:
    """The profile ``rig`` can serve and its numbers; with ``search``, when it does not fit, the
    largest context that would and the fewest GPUs of this memory that would."""
    from flashnext.serving.profiles import load_profile

    template = load_profile(TEMPLATES[rig.mtp])
    text = load_text_config()
    shape = ServingShape.from_profile(template)
    if rig.gpus > text.num_hidden_layers:
        raise FlashnextError(f"{rig.gpus}: the model has {text.num_hidden_layers} layers to split", field="gpus")
    vision = load_vision_config() if shape.images else None
    vision_bytes = vision_plan(vision, shape.vit_stream, shape.max_pixels).vram_bytes if vision else 0
    loads = fixed_loads(rig, rig.gpus, vision_bytes)
    partition = layer_partition(text.num_hidden_layers, loads)
    even = [len(r) for r in rank_layers(text.num_hidden_layers, rig.gpus, None)] == partition
    limit = max_seqs_limit(template, shape.num_speculative_tokens)

    best = None
    for seqs in range(limit, 0, -1):
        attempt = _attempt(template, rig, partition, even, seqs, rig.context)
        if _fits(rig, attempt[2], attempt[3]):
            best = (seqs, attempt)
            break
    seqs, (profile, plan, ranks, host, kv_bytes, table) = best or (0, attempt)
    result = RigPlan(rig, best is not None, [] if best else _reasons(rig, table, host, plan, rig.context),
                     partition, even, seqs, limit, kv_bytes, rig.usable_vram_bytes, ranks, host, plan,
                     profile=profile, table=table)
    if best is None and search:
        weights_fit = all(m.total - m.kv_pool <= rig.usable_vram_bytes for m in ranks)
        if weights_fit:
            result.largest_context_that_fits = _largest_context(template, rig, partition, even)
        else:
            result.fewest_gpus_that_fit = _fewest_gpus(rig, text.num_hidden_layers)
    return result


CONTEXT_STEP = 1024  # the largest context that fits is searched in steps of this many tokens


def _largest_context(template, rig: Rig, partition, even) -> int | None:
    def fits(context: int) -> bool:
        _, _, ranks, host, _, _ = _attempt(template, rig, partition, even, 1, context)
        return _fits(rig, ranks, host)

    low, high = 0, rig.context // CONTEXT_STEP  # fits(low * step) holds (0: vacuously), fits(high * step) does not
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid * CONTEXT_STEP):
            low = mid
        else:
            high = mid
    return low * CONTEXT_STEP or None


def _fewest_gpus(rig: Rig, num_layers: int) -> int | None:
    for gpus in range(rig.gpus + 1, num_layers + 1):
        if plan_rig(dataclasses.replace(rig, gpus=gpus), search=False).fits:
            return gpus
    return None


def describe(result: RigPlan) -> str:
    """A generated profile's description: the rig, the choices and why."""
    rig, plan = result.rig, result.plan
    split = "vLLM's even split" if result.even_split else "VLLM_PP_LAYER_PARTITION"
    ple = ("PLE table on NVMe (--ple-table)" if rig.ple_format == "file"
           else f"PLE table pinned in host memory as {rig.ple_format}")
    mtp = "the MTP draft head (1 draft token) on the last rank, " if rig.mtp else ""
    return (f"Qwen3.8-Flash-Next on {rig.gpus} GPUs of {rig.gpu_memory_bytes / GIB:g} GiB with "
            f"{rig.host_ram_bytes / GIB:g} GiB of host RAM, made by `flashnext plan` from profile "
            f"{TEMPLATES[rig.mtp]}: "
            f"PP{rig.gpus} with layers {'/'.join(map(str, result.partition))} ({split}), {mtp}"
            f"{result.max_num_seqs} sequences of {rig.context:,} tokens ({result.max_num_seqs} x "
            f"{plan.blocks_per_request} blocks of {max(plan.bytes_per_block):,} B), QSA K/V in pinned host memory, "
            f"{ple}.")


def rig_profile(result: RigPlan, name: str):
    """The profile of a plan that fits, named ``name``."""
    if not result.fits:
        raise FlashnextError("the rig does not fit the model (" + "; ".join(result.reasons) + "): no profile written")
    return dataclasses.replace(result.profile, name=name, description=describe(result))
