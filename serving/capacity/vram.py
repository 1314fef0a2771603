"""Each pipeline rank's GPU memory at its peak, in one table: what ``flashnext plan`` leads with.

    weights + KV cache + runtime + flashnext = total;   free = card - total

The columns, per rank, in bytes:

- **weights**: the model's tensors on the rank's GPU, the vision tower's resident part on the
  first rank included. For the pinned base checkpoint, seed 000's measurements of the release
  checkpoint as vLLM 0.34.0 loads it (:func:`seed_weights`) and the tower as the memory ledger
  sizes it (vLLM's own entry, :func:`base_weights`); for a snapshot (``plan --model``), its own
  tensors, summed from its safetensors headers and placed on the ranks as vLLM places them
  (:func:`snapshot_weights`).
- **KV cache**: vLLM's pool, ``--kv-cache-memory-bytes`` in whole blocks (the ledger's
  ``KV memory`` entry, the plan's ``vram_bytes``).
- **runtime**: the rest of what a rank holds at its peak (CUDA context, NCCL, a step's
  activations, CUDA graphs, allocator slack): :data:`RUNTIME_BYTES`, seed 000 §3.5's measurement,
  and on the first rank the vision encoder's activations for one image (the ledger's estimate).
- **flashnext**: flashnext's own allocations at their serving peak: the ledger's GPU entries that
  flashnext's patches own, less those another column already holds (an entry within another, and
  an entry that is the checkpoint's own tensors laid out anew, ``LedgerEntry.checkpoint``: the
  decode-05 router rows, and a step's transients inside vLLM's profiled peak, the INT8
  embedding's rows: the runtime's measurement holds a 512-token step's activations). The seed's
  runtime was measured with its own versions of the small transient entries outside vLLM's
  numbers (decode-07 partials, row slots) inside it; counted here again, they err by a few MiB on
  the safe side.
- **card**: the GPU's memory less :data:`DEVICE_RESERVED_BYTES`, what its driver keeps; **free** is
  the card less the total.

The rig planner (:mod:`.rig`) decides what fits by this table's totals, so the table ``plan``
prints and the verdict it gives are one computation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.serving.capacity.kv import rank_layers
from flashnext.serving.capacity.ledger import KV_MEMORY, PROFILED_PEAK, WEIGHTS, Ledger, LedgerEntry, RankLedger
from flashnext.serving.capacity.shape import ServingShape

GIB = 1 << 30
MIB = 1 << 20

# Seed 000 §6 (after patch mem-01, which vLLM 0.34.0 does itself: embed_tokens on the first rank
# only, lm_head on the last; weights as vLLM loaded them on 16/16/16): rank 1 holds 16 decoder
# layers and nothing else, 20.44 GiB; rank 0 holds 20.98 (its extra: embed_tokens and the PLE
# projections), rank 2 21.05 (its extra: lm_head).
LAYER_WEIGHT_BYTES = round(20.44 * GIB / 16)
FIRST_RANK_WEIGHT_BYTES = round((20.98 - 20.44) * GIB)
LAST_RANK_WEIGHT_BYTES = round((21.05 - 20.44) * GIB)
# Seed 000 §7: the MTP head on the last rank, its routed experts INT4 g128 (make-mtp-int4) 1.17 GiB
# and its dense part 0.17 GiB; its embedding is pinned on the host (mtp-02) and counted there.
DRAFT_WEIGHT_BYTES = round((1.17 + 0.17) * GIB)
# What a rank holds beyond weights, KV pool and arena at its peak (CUDA context, NCCL, activations
# of a 512-token step, CUDA graphs, allocator slack): seed 000 §3.5's peaks, [24,022, 24,090, 24,038]
# MiB with 4 x 247k tokens held at 783,000,000 B, less the weights then ([21.58, 21.55, 21.55] GiB),
# the KV pool and the arena: [1,082, 1,181, 1,129] MiB; the largest
# (tests/serving/test_rig_plan.py derives it again).
RUNTIME_BYTES = 1181 * MIB
# What a GPU's driver keeps out of reach: a 3090's 24,576 MiB allow 24,124 (seed 000 §3.5, where
# 24,126 failed).
DEVICE_RESERVED_BYTES = (24_576 - 24_124) * MIB

COLUMNS = ("weights", "kv_cache", "runtime", "flashnext", "total", "card", "free")


def seed_weights(layers_per_rank: list[int], mtp: bool) -> list[int]:
    """The pinned base checkpoint's language model on each rank (seed 000's measurements): its
    decoder layers, the embedding on the first rank, the LM head (and the MTP draft) on the last."""
    weights = [n * LAYER_WEIGHT_BYTES for n in layers_per_rank]
    weights[0] += FIRST_RANK_WEIGHT_BYTES
    weights[-1] += LAST_RANK_WEIGHT_BYTES + (DRAFT_WEIGHT_BYTES if mtp else 0)
    return weights


def serves_draft(shape: ServingShape) -> bool:
    """Whether the profile serves the MTP draft head."""
    return shape.speculative_method == "mtp" and shape.num_speculative_tokens > 0


def _vllm_weights(rank: RankLedger) -> int:
    """vLLM's own allocations inside its weights number beside the language model: the tower."""
    return sum(e.gpu_peak for e in rank.entries if e.vllms and column_of(e) == "weights")


def base_weights(layers_per_rank: list[int], mtp: bool, ledger: Ledger) -> list[int]:
    """The weights column for the pinned base checkpoint: :func:`seed_weights` and the vision
    tower's resident part as the ledger sizes it."""
    return [w + _vllm_weights(rank) for w, rank in zip(seed_weights(layers_per_rank, mtp), ledger.ranks)]


# --- a snapshot's own tensors, placed as vLLM 0.34.0 places them ------------------------------------

_LAYER = re.compile(r"(?:model\.language_model\.|model\.)layers\.(\d+)\.")
_VISION_BLOCK = re.compile(r"model\.visual\.blocks\.\d+\.")
# The PLE table: served from a file (ple-mmap) or pinned in host memory (engram cpu_offload), never
# on a GPU; the plan's host lines count it.
_PLE_TABLE = ".ple_embedding.ngram_embedding."
# What the loaders drop (Qwen4ExpModel.load_weights' skip_substrs, the MTP loaders' mapper).
_DROPPED = ("hyper_connection_mixer.block_inject_weight", "hashstats_", "token_lookup")


def _ranks_of(name: str, rank_of: dict[int, int], last: int, shape: ServingShape, streamed: bool) -> list[int] | None:
    """The ranks whose GPU holds tensor ``name`` (twice a rank for a second copy): none where vLLM
    keeps it off the GPUs or loads it not at all; None where the plan cannot tell."""
    draft = serves_draft(shape)
    if any(s in name for s in _DROPPED) or _PLE_TABLE in name:
        return []
    if name.startswith("model.visual."):
        return [0] if shape.images and not (streamed and _VISION_BLOCK.match(name)) else []
    if name.startswith("mtp."):
        return [last] if draft else []
    layer = _LAYER.match(name)
    if layer:
        return [rank_of[int(layer[1])]] if int(layer[1]) in rank_of else None
    # at PP > 1 the draft shares the target's embedding (pinned on the host) and LM head; with
    # mtp-02 off (VLLM_MTP_SLIM_DRAFT=0) it loads its own copies of both on the last rank
    copy = [last] if draft and last > 0 and not shape.mtp_slim_draft else []
    if name.startswith("lm_head."):
        return [last, *copy]
    rest = next((name[len(p):] for p in ("model.language_model.", "model.") if name.startswith(p)), None)
    if rest is None:
        return None
    if rest.startswith("embed_tokens."):
        return [0, *copy]
    if rest.startswith(("norm.", "hyper_connection_mixer.")):
        return [last]
    return None


def snapshot_weights(deployment, text, shape: ServingShape, plan) -> tuple[list[int] | None, list[str]]:
    """The weights column for the deployment's model (its served model: the snapshot with its
    overlays): each tensor vLLM loads onto a GPU for the
    profile (``shape``, ``plan``), as many bytes as its safetensors header gives, on the rank vLLM
    builds its module on: decoder layer i's tensors (its PLE projections included) on the rank
    holding layer i; the embedding and the vision tower on the first rank (the tower's blocks not
    where vit-stream keeps them in host memory); the final norm, mixer and LM head, and the MTP
    draft where the profile serves it, on the last. Not on a GPU: the PLE table, a tower the
    profile does not serve, a draft it does not. With the notes to print: what could not be placed
    (not counted), or why there are no weights (None: a config.json without its snapshot)."""
    from flashnext.quant.checkpoint.snapshot import INDEX_FILE

    model = deployment.model
    root = Path(model)
    if not root.is_dir():
        root = root.parent
        if not (root / INDEX_FILE).is_file():
            return None, [f"weights: {model} is a config.json without its snapshot's {INDEX_FILE} beside it: "
                          "give the snapshot's directory to count them"]
    snap = deployment.open_snapshot(root)
    ranks = rank_layers(text.num_hidden_layers, shape.pipeline_parallel_size, shape.layer_partition)
    rank_of = {i: r for r, layers in enumerate(ranks) for i in layers}
    streamed = plan.vision is not None and plan.vision.streamed_weight_bytes < plan.vision.resident_weight_bytes
    weights = [0] * len(ranks)
    unplaced: list[str] = []
    unplaced_bytes = 0
    for name in snap.weight_map:
        on = _ranks_of(name, rank_of, len(ranks) - 1, shape, streamed)
        if on == []:
            continue
        nbytes = snap.entry(name)[1].nbytes  # the header's: no tensor is read
        if on is None:
            unplaced.append(name)
            unplaced_bytes += nbytes
        for rank in on or ():
            weights[rank] += nbytes
    notes = []
    if unplaced:
        from flashnext.sizes import format_size

        notes.append(f"weights: {len(unplaced)} tensor(s) of {model} ({format_size(unplaced_bytes)}) are on no "
                     f"rank the plan knows and are not counted: {', '.join(unplaced[:3])}"
                     f"{', ...' if len(unplaced) > 3 else ''}")
    return weights, notes


# --- the table ----------------------------------------------------------------------------------------

@dataclass
class RankVram:
    """One rank's row; bytes. ``weights`` None: unknown (and so the total and what is free)."""

    rank: int
    layers: int
    weights: int | None
    kv_cache: int
    runtime: int
    flashnext: int
    card: int | None

    @property
    def total(self) -> int | None:
        return None if self.weights is None else self.weights + self.kv_cache + self.runtime + self.flashnext

    @property
    def free(self) -> int | None:
        return None if self.card is None or self.total is None else self.card - self.total

    def to_json(self) -> dict:
        return {"rank": self.rank, "layers": self.layers,
                **{f"{c}_bytes": getattr(self, c) for c in COLUMNS}}


@dataclass
class VramTable:
    ranks: list[RankVram]
    gpu_memory_bytes: int | None  # None: no card known (the card and free columns are left out)
    weights_from: str  # where the weights column comes from, in words
    notes: list[str] = field(default_factory=list)
    ledger: Ledger | None = field(default=None, repr=False)  # whose entries the columns sum

    @property
    def card_bytes(self) -> int | None:
        return None if self.gpu_memory_bytes is None else usable_bytes(self.gpu_memory_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether every rank's total fits its card; None where the card or the weights are unknown."""
        free = [r.free for r in self.ranks]
        return None if None in free else min(free) >= 0

    def column_total(self, column: str) -> int | None:
        values = [getattr(r, column) for r in self.ranks]
        return None if None in values else sum(values)

    def to_json(self) -> dict:
        return {"columns": list(COLUMNS), "gpu_memory_bytes": self.gpu_memory_bytes,
                "device_reserved_bytes": DEVICE_RESERVED_BYTES, "card_bytes": self.card_bytes,
                "weights_from": self.weights_from, "runtime_measured_bytes": RUNTIME_BYTES,
                "ranks": [r.to_json() for r in self.ranks],
                "all": {"layers": sum(r.layers for r in self.ranks),
                        **{f"{c}_bytes": self.column_total(c) for c in COLUMNS}},
                "fits": self.fits, "notes": list(self.notes)}


def usable_bytes(gpu_memory_bytes: int) -> int:
    """What a GPU of ``gpu_memory_bytes`` gives a process: less what its driver keeps."""
    return gpu_memory_bytes - DEVICE_RESERVED_BYTES


def check_gpu_memory(gib: float, field: str) -> float:
    """``gib``, the GiB of one GPU's memory that the input ``field`` gives, refused unless a profile's
    ``gpu_memory_gib`` could hold it (from 1 GiB, beside the 0.44 GiB the driver keeps, to 1 TiB)."""
    from flashnext.serving.profiles import MAX_GPU_MEMORY_GIB, MIN_GPU_MEMORY_GIB

    if not (math.isfinite(gib) and MIN_GPU_MEMORY_GIB <= gib <= MAX_GPU_MEMORY_GIB):
        raise FlashnextError(f"must be a number of GiB from {MIN_GPU_MEMORY_GIB} to {MAX_GPU_MEMORY_GIB}, "
                             f"got {gib:g}", field=field)
    return gib


def column_of(entry: LedgerEntry) -> str | None:
    """The table column that holds a ledger entry's GPU bytes; None for an entry within another
    (its bytes are that one's). vLLM's weights entries (the tower) and entries that are the
    checkpoint's tensors laid out anew are the weights column's: :func:`base_weights` adds the
    tower for the base checkpoint, a snapshot's tensors hold both; vLLM's transients (the vision
    encoder's activations) are the runtime's; flashnext's transients inside vLLM's profiled peak
    (the INT8 embedding's rows) are None: a step's activations, which the runtime's measurement
    holds (seed 000 served the release's INT8 embedding); everything else of flashnext's is
    flashnext's own."""
    if entry.within is not None or (not entry.vllms and entry.inside == PROFILED_PEAK):
        return None
    if entry.inside == KV_MEMORY:
        return "kv_cache"
    if entry.checkpoint or (entry.vllms and entry.inside == WEIGHTS):
        return "weights"
    return "runtime" if entry.vllms else "flashnext"


def ledger_columns(rank: RankLedger) -> dict[str, int]:
    """One rank of the memory ledger by column: each column's bytes at their serving peak."""
    sums = dict.fromkeys(("weights", "kv_cache", "runtime", "flashnext"), 0)
    for e in rank.entries:
        column = column_of(e)
        if column is not None:
            sums[column] += e.gpu_peak
    return sums


def vram_table(ledger: Ledger, layers_per_rank: list[int], weights: list[int] | None, gpu_memory: int | None,
               weights_from: str, notes: list[str] = ()) -> VramTable:
    """The table of one plan: its ``ledger``, the weights column, and each GPU's memory (bytes; None: unknown)."""
    card = None if gpu_memory is None else usable_bytes(gpu_memory)
    rows = []
    for r, rank in enumerate(ledger.ranks):
        columns = ledger_columns(rank)
        rows.append(RankVram(r, layers_per_rank[r], None if weights is None else weights[r], columns["kv_cache"],
                             RUNTIME_BYTES + columns["runtime"], columns["flashnext"], card))
    return VramTable(rows, gpu_memory, weights_from, list(notes), ledger)


SEED_WEIGHTS = "seed 000's measurements of the release checkpoint (§6, §7)"


def profile_vram(profile, plan, ledger: Ledger, gpu_memory: int | None, deployment=None) -> VramTable:
    """The table of a ``qwen4_exp`` ``profile``'s ``plan`` against GPUs of ``gpu_memory`` bytes (None:
    unknown), for the model of ``deployment`` (a :class:`~flashnext.serving.deployment.Deployment`,
    whose config.json and served model are read once; None, or one without a model: the pinned base
    checkpoint)."""
    from flashnext.serving.capacity.model import load_text_config

    shape = ServingShape.from_profile(profile, plan.kv_cache_memory_bytes, plan.prefix_caching)
    model = deployment.model if deployment is not None else None
    if model is None:
        return vram_table(ledger, plan.layers_per_rank, base_weights(plan.layers_per_rank, serves_draft(shape), ledger),
                          gpu_memory, SEED_WEIGHTS)
    text = load_text_config(deployment.model_config)
    weights, notes = snapshot_weights(deployment, text, shape, plan)
    source = f"{model}'s tensors, as its safetensors headers size them" if weights is not None else "not known"
    return vram_table(ledger, plan.layers_per_rank, weights, gpu_memory, source, notes)
