"""The vLLM patch series, one entry a patch, in the order the patches apply.

After vLLM's own model registry (``vllm/model_executor/models/registry.py``): each fact about a
patch lives in its entry here, as code (its off switch is declared here and read through
``flashnext.envs`` by name), or in its diff, ``<id>.patch``, whose preamble is its prose and from
which the files it touches and its probe are read (a plugin entry: its prose in ``<id>.md``, its
probe a function in ``probes.py``). A new patch is three files: the diff, its entry, its hook. The
READMEs' tables and lists, ``docs/serving.md``'s patch sections and ``flashnext patches list`` are
generated from this module (``flashnext patches readme --write``), and a test keeps them equal to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from flashnext.envs import EnvVar
from flashnext.serving.patches import probes

PATCH_DIR = Path(__file__).resolve().parent
# The vLLM release every diff is taken against; `patches check` applies them with zero fuzz.
VLLM_VERSION = "0.34.0"


@dataclass(frozen=True)
class Coverage:
    """What the tests of a patch really drive (the patches README's second table)."""

    vllm_cpu: str  # vLLM's own code that the tests run on the CPU
    gpu: str  # what ran on a GPU
    stand_in: str  # what a stand-in replaces, and why
    gap: str  # what a real serve meets that no test drives


@dataclass(frozen=True)
class Patch:
    id: str
    order: int
    file: str | None  # the unified diff against vllm==VLLM_VERSION, in PATCH_DIR; None for a plugin
    seed: str | None  # the seed 000 item it ports, where the seed named one
    switch: EnvVar  # the variable that turns it off, declared here (flashnext.envs reads it by name)
    hooks: tuple[str, ...]  # the dotted paths of the flashnext code the patched vLLM calls
    upstream: str
    seed_effect: str  # seed 000's measured effect
    tests: str  # the tests that drive it, each path in backticks
    coverage: Coverage
    switch_off: str = "0"  # the switch's value that turns the patch off
    # A plugin entry: the dotted path of the function flashnext's vLLM general plugin
    # (serving/plugin.py) calls to register it through one of vLLM's own extension points.
    registers: str | None = None
    why_diff: str | None = None  # a diff entry: why no extension point of vLLM's serves it
    # Raises unless the patched tree it runs in has the patch. A diff's is derived from the diff
    # (patch_series.probe_call: the lines it adds stand in the tree); a plugin entry names its own.
    probe: Callable[..., None] | None = None

    @property
    def verdict(self) -> str:
        """``diff`` (kept as a diff: no extension point of vLLM's serves it) or ``plugin``."""
        return "plugin" if self.registers is not None else "diff"

    @property
    def path(self) -> Path:
        if self.file is None:
            raise ValueError(f"{self.id} is registered through vLLM's plugin points and has no diff")
        return PATCH_DIR / self.file

    @property
    def prose_path(self) -> Path:
        """Where the patch's prose is: the preamble of its diff (``patch`` skips the text before the
        first file header), or a plugin entry's ``<id>.md``."""
        return self.path if self.file is not None else PATCH_DIR / f"{self.id}.md"

    @property
    def touches(self) -> tuple[str, ...]:
        """The files of the vllm package the diff changes, read from its file headers."""
        if self.file is None:
            return ()
        return tuple(dict.fromkeys(probes.diff_files(self.path.read_text(encoding="utf-8"))))

    @property
    def env_switch(self) -> str:
        """``NAME=OFF``: the switch set to turn the patch off."""
        return f"{self.switch.name}={self.switch_off}"


@dataclass(frozen=True)
class Absorbed:
    """A patch of an earlier release that vLLM made unnecessary: dropped from the series, kept here
    with the evidence. Its probe finds upstream's fix in a tree (``patches check`` reports it as
    absorbed, or as regressed when a later release loses the fix and the patch must come back)."""

    id: str
    seed: str | None  # the seed 000 item it ported
    since: str  # the vLLM release whose own code fixes it
    fixed_by: str  # what in that release fixes it, by file and name
    probe: Callable[[], None]  # raises unless the tree it runs in has upstream's fix
    seed_effect: str  # seed 000's measured effect of the dropped patch
    tests: str  # the test that runs the seed's failure on stock vLLM and shows it fixed

    touches = ()  # no file of vLLM's: the probe runner checks each entry's touched files

SERIES: tuple[Patch, ...] = (
    Patch(
        id="ple-mmap", order=1, file="ple-mmap.patch", seed=None,
        switch=EnvVar("VLLM_PLE_MMAP_PATH", "", "Patch ple-mmap: the PLE table file made by `flashnext ple build`; empty: vLLM's own table."), switch_off="",
        hooks=("flashnext.serving.hooks.ple_file",),
        why_diff="the PLE embedding backend is chosen inside Qwen4ExpNGramEmbedding.__init__ from engram_config, which no registry reaches, and it must be chosen before the table is allocated. The staging of each step's rows is no diff: it runs in flashnext's model state, which the model class registered through vLLM's ModelRegistry hands the runner (decode-06 and ttft-01's registration).",
        upstream="not upstream in 0.34.0 as such (verified: no VLLM_PLE_MMAP_PATH, MADV_RANDOM or process_madvise in vLLM). 0.34.0 adds engram `disk_offload` (Qwen4ExpPLEDiskOffloadEmbedding, stage_checkpoint_rows), the same design over the checkpoint's own shard files: each step's rows read on the host (POSIX_FADV_WILLNEED on their pages, then one preadv a row) into fixed device buffers the forward reads; no table file, no random-access advice, no prompt read-ahead. Drop ple-mmap (with decode-06 and ttft-01) once that path is measured on the 3x3090 system's NVMe to match it: bytes read per token, decode ITL, cold-prompt TTFT.",
        seed_effect="the 262k-context 3x3090 system needs it (seed 000 §1); `MADV_RANDOM` keeps NVMe reads to the rows (readahead: 23x; the AutoRound card: 922 KiB -> 39.5 KiB per token)",
        tests="`tests/serving/test_patch_series.py::test_ple_file_is_served_by_vllms_runner_through_flashnexts_model_state`: vLLM's own `GPUModelRunner` (its `load_model`, `initialize_kv_cache` and each step's request bookkeeping and `prepare_inputs`) with the model class vLLM's registry resolves and the model state vLLM's `init_model_state` makes, two requests from vLLM's own `Scheduler` (chunked prefill, a prefix-cache hit): at every step the PLE layer's embeddings equal stock vLLM's bit for bit (the table in device memory, flashnext's plugin left out), the staged row ids equal vLLM's kernel's, prefill-only steps copy no ids from the device, an empty path gives the stock backend, and the file is refused without flashnext's plugin; `tests/serving/hooks/test_ple_file.py`; `tests/quant/ple/test_ple_hash.py` (the numpy twin the host hashes with, against vLLM's kernel)",
        coverage=Coverage(
            vllm_cpu="vLLM's GPUModelRunner on CPU (load_model with the registry-resolved model, init_model_state, initialize_kv_cache, finish/add/update_requests, gather_batch_req_state, dispatch_cg_and_sync_dp, prepare_inputs, postprocess_sampled) and its Scheduler over 6 steps of 2 requests; patched Qwen4ExpNGramEmbedding picks FileBackedPLEEmbedding, loaded by its own load_weights; flashnext's state stages each step: prefill steps hashed on the host, others by vLLM's Triton kernel (interpreter); embeddings bit-identical to stock.",
            gpu="none of the patched path; benchmarks/ple_ids_sync.py on the H200 timed the per-step ids D2H sync in plain torch (an elementwise stand-in for vLLM's hash kernel)",
            stand_in="CUDA streams/events are no-op objects and UVA buffers vLLM's explicit-copy fallback; only the PLE layer of the forward runs (quant config dropped, only PLE tensors loaded: no CPU kernel for the demo's INT4/INT6); a stand-in sampler (token 7+step) fed to vLLM's postprocess_sampled and update_from_output; text-only (no tokenizer for the MM budget); staged_rows is a CPU tensor, so stage() takes its non-GPU branch.",
            gap="stage()'s GPU branch (pinned staging, non_blocking H2D, CUDA event), the forward under FULL_DECODE_ONLY capture, and the remaining sync of decode/verify steps on a GPU (PP=3, async scheduling) never run; a 95 GiB table on NVMe next to pinned K/V (page cache pressure) unmeasured (bench: 8.7 GB file, virtio disk).",
        ),
    ),
    Patch(
        id="decode-06", order=2, file=None, seed="decode-06",
        switch=EnvVar("VLLM_PLE_DECODE_ADVICE", "1", "Patch decode-06: 0 turns off the per-step advice of a decode step's PLE rows before the gather."),
        hooks=("flashnext.serving.hooks.ple_file.PleFileServing.advise",),
        registers="flashnext.serving.models.qwen4_exp.register",
        probe=probes.qwen4_exp_model_state,
        upstream="not upstream in 0.34.0 (verified: no process_madvise anywhere in vLLM; 0.34.0's disk offload queues POSIX_FADV_WILLNEED on each step's page runs, for its own backend only); drop with ple-mmap. A plugin since 0.34.0: Model Runner V2 takes the model state from the model (get_model_state_cls), and vLLM's ModelRegistry.register_model lets flashnext's plugin register vLLM's qwen4_exp classes with its state subclass under vLLM's architecture names.",
        seed_effect="8k: p90 ITL 16 -> 12.4-13.0 ms, mean 72-74 -> 80-82 tok/s (§3.4)",
        tests="the same test: vLLM's runner prepares 6 steps through flashnext's model state; only the one-token decode step is advised, prefill and mixed steps (over 256 rows) are not, nothing with the switch off; `tests/serving/hooks/test_ple_file.py::test_decode_advice_only_for_small_steps`",
        coverage=Coverage(
            vllm_cpu="vLLM's GPUModelRunner and Scheduler on CPU drive flashnext's Qwen4ExpModelState subclass (made by vLLM's init_model_state from the class vLLM's registry resolved): its prepare_inputs advises the 1-token decode step and not the 1,024/448/28-token prefill or 257/45-token mixed steps, with real process_madvise/madvise syscalls on the demo table file.",
            gpu="none",
            stand_in="as ple-mmap's runner test: no-op CUDA streams/events, only the PLE layer of the forward, a stand-in sampler; the demo table is small and page-cache warm, so no fault latency exists to hide.",
            gap="The ITL effect (p90 16 -> 12.4 ms, seed) is never measured; cold NVMe faults during a real decode step, and process_madvise inside the container (seccomp + CAP_SYS_PTRACE) on the rig untested; DecodeAdvisor timed only on the dev VM (19.6 us).",
        ),
    ),
    Patch(
        id="ttft-01", order=3, file=None, seed="ttft-01",
        switch=EnvVar("VLLM_PLE_PREFETCH", "1", "Patch ttft-01: 0 turns off the prompt prefetcher (each admitted prompt's PLE pages, advised ahead)."),
        hooks=("flashnext.serving.hooks.ple_file.PleFileServing.admitted",),
        registers="flashnext.serving.models.qwen4_exp.register",
        probe=probes.qwen4_exp_model_state,
        upstream="not upstream in 0.34.0 (verified: nothing reads a prompt's PLE rows ahead when it is admitted, 0.34.0's disk offload included); drop with ple-mmap. A plugin since 0.34.0: the model state's add_request/remove_request, from the model class flashnext's plugin registers (decode-06's registration).",
        seed_effect="cold 37k-token prompts: 44 s to first token without; 4,430 tok/s prefill with it; warm unchanged (§1)",
        tests="the same test: vLLM's runner adds each request vLLM's scheduler admits: the 1,500-token prompt is advised in 2 windows, the second request's 300 tokens past its 1,472-token prefix-cache hit in 1, each exactly the rows its prefill staged; the first is cancelled when it finishes; none with the switch off; `tests/quant/ple/test_ple_prefetch.py` for the prefetcher itself",
        coverage=Coverage(
            vllm_cpu="vLLM's GPUModelRunner.add_requests/finish_requests call flashnext's model state's add_request/remove_request with vLLM's NewRequestData from vLLM's Scheduler (prefix caching, mamba align): the PromptPrefetcher thread hashes each request's uncomputed tokens (num_computed_tokens skipped) and advises them; the rows equal those the prefill staged (vLLM's kernel); the finished request is cancelled.",
            gpu="none",
            stand_in="as ple-mmap's runner test (no-op CUDA streams, PLE layer only, stand-in sampler, text-only requests); the cold-disk benchmark ran on the dev VM's virtio disk (5.5x, 10x target missed).",
            gap="No image placeholders or preemption (a resume's prefill_token_ids) in the driven requests; the prefetch thread's GIL contention with rank 0's step loop; cold 37k-token TTFT on real NVMe unmeasured.",
        ),
    ),
    Patch(
        id="host-pool", order=4, file="host-pool.patch", seed=None,
        switch=EnvVar("VLLM_EXACT_HOST_POOL", "1", "Patch host-pool: 0 returns to PyTorch's caching host allocator (power-of-two rounding)."),
        hooks=("flashnext.serving.hooks.host_pool.pinned_empty",),
        why_diff="the pinned table is allocated by a method of Qwen4ExpPLEPinnedHostEmbedding, a class Qwen4ExpNGramEmbedding picks itself; no extension point allocates pinned weights.",
        upstream="not upstream in 0.34.0 for qwen4_exp (verified: Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight is still torch.empty(pin_memory=True); vLLM registers exact sizes only for its own CPU KV offload, v1/kv_offload/cpu/host_register.py); drop when vLLM allocates pinned weights at exact size.",
        seed_effect="at 590 MB, 112 GiB used and 13 GiB free; each 4.24 GiB pool pinned as 8 GiB (§2)",
        tests="`tests/serving/hooks/test_host_pool.py` (CPU: exact size, the RAM check, the lock; H200: pinned, read by a CUDA kernel through unified addressing as vLLM's pinned lookup reads it, and 32 MiB taken by PyTorch for 20 MiB with the switch off); `benchmarks/host_pool.py` in `docs/benchmarks.md`",
        coverage=Coverage(
            vllm_cpu="tests/serving/test_engine_ledger_ple_pinned.py: Model Runner V2 with engram cpu_offload on builds Qwen4ExpPLEPinnedHostEmbedding, whose allocate_embedding_weight takes one exact-size pool of the ledger's bytes, filled by vLLM's loader and read by its own lookup kernel through its profile run and scheduler's steps; pinned_empty also runs under vLLM's init_kv_cache via qsa-offload's bind (register=False on CPU).",
            gpu="test_host_pool.py on the H200: test_pinned_on_the_gpu, test_pinned_empty_on_the_gpu (UVA gather; 32 MiB taken by PyTorch for 20 MiB), test_draft_embedding_read_through_uva; benchmarks/host_pool.py (1.5/4.24/20 GiB). No vLLM there.",
            stand_in="CPU tests pass register=False or a cudaHostRegister that locks nothing, and a fake /proc/meminfo; the PLE scenario's UVA view is the table itself (its lookup kernel under Triton's interpreter, handed bytes); on the H200 the UVA read is flashnext's uva_view + torch indexing, not vLLM's get_accelerator_view_from_cpu_tensor / lookup_from_pinned.",
            gap="vLLM's pinned PLE embedding over a page-locked pool is never read on a GPU (and 3x3090 profiles refuse to start without --ple-table, so that call site is off there); the rig's real load, ~48-68 GiB of pools registered by 3 ranks under the lock with memlock/cgroup limits, untested.",
        ),
    ),
    Patch(
        id="mtp-01", order=5, file="mtp-01.patch", seed="mtp-01",
        switch=EnvVar("VLLM_MTP_PP", "1", "Patch mtp-01: 0 builds the MTP draft's embed_tokens and lm_head without the checkpoint's INT8 method again (stock vLLM, whose loader then refuses the release's INT8 draft tensors)."),
        hooks=("flashnext.serving.hooks.mtp.draft_embedding_method",),
        why_diff="qwen4_exp's draft builds its VocabParallelEmbedding and ParallelLMHead with no quantization config, so no registered config is ever asked for their method.",
        upstream="not upstream in 0.34.0 (verified: the draft's `VocabParallelEmbedding(self.vocab_size, self.hidden_size)` and its `ParallelLMHead` get no quantization method, so vLLM's loader refuses the release's INT8 draft tensors; the other half of the seed's mtp-01, the forward's branch on the global first rank, is fixed in 0.34.0: ABSORBED); drop when the draft builds its embedding and LM head with the checkpoint's quantization.",
        seed_effect="MTP under PP at all: stock failed at startup (§7)",
        tests="`tests/serving/patches/test_draft_head_under_pp.py`: vLLM's own `Qwen4ExpMTP` made by vLLM's `load_eagle_model` (default loader over the demo snapshot, then the drafter's sharing) on the last of two gloo ranks: the draft's embedding loads the INT8 rows, `embed_input_ids` equals the checkpoint's rows dequantized by compressed-tensors' unpacker, and the draft's forward (0.34.0's own branch) embeds them and runs through; `tests/serving/patches/test_mtp01_switch.py::test_mtp01_off_builds_the_draft_embedding_as_stock_and_vllm_refuses_the_int8_rows`: with the switch off the draft's embedding is vLLM's unquantized one and vLLM's loader refuses `embed_tokens.weight_packed`, as stock 0.34.0's does",
        coverage=Coverage(
            vllm_cpu="vLLM's Qwen4ExpMTP made by V2's load_eagle_model (get_model, default loader over the demo snapshot, Qwen4ExpMTP.load_weights, drafter sharing) on the last of two gloo ranks: the draft's VocabParallelEmbedding gets Int8EmbeddingMethod, embed_input_ids = dequantized rows; Qwen4ExpMultiTokenPredictor.forward embeds.",
            gpu="none",
            stand_in="the draft forward runs under set_forward_context(None) (no attention metadata, so its QSA layer does the profile no-op); routed experts' kernel and CPUUnquantizedExperts post-load stubbed; dispatch_cpu_unquantized_gemm -> F.linear; quant config narrowed to INT8 groups.",
            gap="No real propose step: V2's MTP drafter on rank 2 at PP=3 with real attention metadata, target hidden states via NCCL, its CUDA-graph capture, and acceptance rate are never run; the make-mtp-int4 INT4 experts under Marlin are not loaded in these tests.",
        ),
    ),
    Patch(
        id="mtp-02", order=6, file="mtp-02.patch", seed="mtp-02",
        switch=EnvVar("VLLM_MTP_SLIM_DRAFT", "1", "Patch mtp-02: 0 gives the draft head its own lm_head copy and a device embedding again under PP."),
        hooks=("flashnext.serving.hooks.mtp.draft_lm_head", "flashnext.serving.hooks.mtp.draft_embedding", "flashnext.serving.hooks.mtp.finish_draft_embedding",),
        why_diff="the draft decides in its own __init__ which heads to build and load_weights loads them; the drafter only replaces them afterwards, with no hook in between.",
        upstream="not upstream in 0.34.0 (verified: Qwen4ExpMTP still builds an lm_head, and at PP=1 an embed_tokens, that load_eagle_model's share_target_lm_head / maybe_share_target_embed replace right after loading; no host-resident draft embedding); drop when vLLM's drafter stops building heads it replaces and offers host-resident draft embeddings.",
        seed_effect="with mem-01, what fits the MTP head on the third 3090: the copy's load-time repack OOMed rank 2 (0.6 GiB), and the embedding moved 0.60 GiB to the host (§7)",
        tests="`tests/serving/patches/test_draft_head_under_pp.py`: at PP=2 the draft on the last rank builds and loads no lm_head and gets the target's; the INT8 bytes it would pin equal `draft_embedding_pinned_bytes`; at PP=1 it builds neither and shares both of the target's INT8 layers; with the switch off the copies are built and loaded (INT8) and then replaced, as stock. On the H200 the pinning itself: `tests/serving/patches/test_draft_embedding_uva.py` (the INT8 words and scales in one pinned pool of exactly `draft_embedding_pinned_bytes`, no device memory but the 16-byte shape, rows gathered through UVA equal to the codes times scales) and `tests/serving/hooks/test_host_pool.py::test_draft_embedding_read_through_uva` (bf16)",
        coverage=Coverage(
            vllm_cpu="Same vLLM build as mtp-01: Qwen4ExpMTP's lm_head is PPMissingLayer, skipped by the loader and replaced by the target's ParallelLMHead in load_eagle_model; at PP=1 embed_tokens too; at PP=2 the draft's INT8 embedding loads and its would-be pinned bytes equal draft_embedding_pinned_bytes.",
            gpu="test_host_pool.py::test_draft_embedding_read_through_uva (bf16) and test_draft_embedding_uva.py::test_int8_draft_embedding_read_through_uva (the release's INT8 layout) passed on the H200, 2026-12-02 (docs/benchmarks.md); no vLLM there.",
            stand_in="On CPU draft_embedding skips its torch.device('cpu') branch and finish_draft_embedding returns early (no CUDA): pinning is only counted; the GPU tests use a bare nn.Module/nn.Embedding and flashnext's dequantize, not VocabParallelEmbedding/Int8EmbeddingMethod.embedding.",
            gap="Never run end to end: a CPU-built embedding inside a CUDA-built Qwen4ExpMTP through vLLM's process_weights_after_loading (device_loading_context), the UVA swap, then Int8EmbeddingMethod.embedding gathering over PCIe in the drafter's CUDA graph on a 3090; rank 2's 0.6 GiB saving.",
        ),
    ),
    Patch(
        id="decode-03", order=7, file="decode-03.patch", seed="decode-03",
        switch=EnvVar("VLLM_PP_DEFER_RECV", "1", "Patch decode-03: 0 receives the previous pipeline rank's tensors first thing in execute_model again."),
        hooks=("flashnext.serving.hooks.pipeline.deferred_intermediate_tensors",),
        why_diff="the receive is inline in Worker.execute_model; vLLM's --worker-cls takes a worker class, but overriding execute_model would copy about a hundred lines of it, a larger fork than the diff.",
        upstream="not upstream in 0.34.0 (verified: Worker.execute_model still calls irecv_tensor_dict first; the AsyncIntermediateTensors it wraps the result in defers only the tensor wait, while the metadata recv_object blocks there); drop when vLLM defers the whole receive.",
        seed_effect="short-context steps were floored at ~12.5 ms by host-side serial work (§3.2)",
        tests="`tests/serving/test_patch_series.py::test_decode03_overlaps_preparation_with_the_previous_rank`: two gloo ranks with vLLM's own `isend_tensor_dict` / `irecv_tensor_dict`; rank 0 sends after 1.0 s, rank 1 prepares for 0.6 s: ready at 1.01 s deferred against 1.61 s stock, same tensors",
        coverage=Coverage(
            vllm_cpu="vLLM's GroupCoordinator.isend_tensor_dict/irecv_tensor_dict on two gloo ranks with vLLM's pipeline groups; rank 1 receives through DeferredRecvIntermediateTensors (a subclass of vLLM's AsyncIntermediateTensors, whose own wait it runs) from the hook the patched Worker.execute_model calls; stock, through vLLM's AsyncIntermediateTensors as 0.34.0's worker makes it.",
            gpu="none",
            stand_in="Worker.execute_model and the V2 runner are not run: sleeps stand in for rank 0's forward (1.0 s) and rank 1's input preparation (0.6 s); the scenario reads .tensors and calls wait_for_comm() as runner and worker would; gloo instead of NCCL.",
            gap="The patched Worker.execute_model never executes; V2 GPUModelRunner's copy out of intermediate_tensors.tensors, NCCL device-tensor receives on CUDA streams, PP=3 batch queue with several batches in flight, and the ~12.5 ms ITL floor (seed) are unmeasured.",
        ),
    ),
    Patch(
        id="qsa-indexer-quant", order=8, file="qsa-indexer-quant.patch", seed=None,
        switch=EnvVar("VLLM_QSA_INDEXER_OWN_SCHEME", "1", "Patch qsa-indexer-quant: 0 merges the QSA indexer projection into q/k/v as vLLM 0.33.0 does, even when the checkpoint quantizes them differently (the release's INT8 indexer then fails to load)."),
        hooks=("flashnext.serving.hooks.qsa_indexer_quant.fuse_indexer_projection",),
        why_diff="the merge is decided inline in Qwen4ExpQSAAttention.__init__ by comparing quant-method types, which one compressed-tensors config gives every scheme alike.",
        upstream="not upstream in 0.34.0 (verified: Qwen4ExpQSAAttention now skips the merge when the indexer's quant method is of another type than q/k/v's, but compressed-tensors gives every part its CompressedTensorsLinearMethod, and `_match_fused_layer` still returns the first part's target without comparing the parts' schemes: stock 0.34.0 builds the release's merged layer INT6 group 64 and stops loading it, tests/serving/patches/test_qsa_indexer_quant.py); drop when vLLM compares the parts' schemes, not their methods' types.",
        seed_effect="the release's QSA layers load at all (stock vLLM 0.33.0 and 0.34.0 stop in their loader with an AssertionError), the indexer's keys from its own INT8 weights; seed 000 reports no number of its own for this",
        tests="`tests/serving/patches/test_qsa_indexer_quant.py`: vLLM's own demo model on the CPU with the checkpoint's whole quantization config and sm86 kernel choice, one QSA layer loaded by vLLM's own loader: stock builds the merged layer INT6 group 64 and refuses the indexer's tensors; patched, q/k/v (INT6, Humming) and the indexer (INT8 group 128) hold exactly the checkpoint's weights, and the indexer projection through its own scheme matches an fp32 reference from the checkpoint; switch off: stock again",
        coverage=Coverage(
            vllm_cpu="vLLM's demo model on CPU with the checkpoint's full CompressedTensorsConfig and vLLM's kernel chooser: stock Qwen4ExpQSAQKVIndexerLinear (Humming uint6b32 g64) fails in vLLM's loader; patched, QKVParallelLinear (Humming INT6) and ReplicatedLinear (Marlin INT8) load exact checkpoint words.",
            gpu="none",
            stand_in="kernels_see_capability(86) makes vLLM's chooser see an sm86 GPU; the INT8 indexer GEMM runs vLLM's batch-invariant dequant+matmul (fp32 inputs) instead of Marlin; the INT6 q/k/v GEMM (Humming) is not run at all; only layer 3's tensors loaded.",
            gap="Marlin/Humming process_weights_after_loading repacks and GEMMs on a 3090, the unmerged QSA forward (one extra launch) feeding the real indexer and fused qsa_prepare at release shapes, and the release's QSA layers loading whole, never run.",
        ),
    ),
    Patch(
        id="qsa-offload", order=9, file="qsa-offload.patch", seed="decode-07",
        switch=EnvVar("VLLM_QSA_KV_OFFLOAD", "0", "Patch qsa-offload: 1 keeps the QSA main K/V in pinned host memory, with the attention block size of seed 000 (what `flashnext plan` models); 0 (vLLM's default) keeps it in VRAM."),
        hooks=("flashnext.serving.hooks.qsa_offload",),
        why_diff="the QSA layer's KV spec, forward and bind are methods of vLLM's own attention classes, and the block-size alignment is a Platform method that only a platform plugin replacing the whole CUDA platform could take.",
        upstream="not upstream in 0.34.0 (verified: the QSA main K/V is a FullAttentionSpec in VRAM; HiSparse's host-resident groups are a separate block space for MLA index groups); drop when vLLM offloads QSA K/V rows to host memory.",
        seed_effect="262,144 x 4 tokens at 550-783 MB of KV VRAM instead of ~122k without offload (§1, §2, §10); decode-07: one layer 174 -> 78 us at 72% overlap on a 3090, hit rate 86-91% (§5)",
        tests="`tests/serving/patches/test_qsa_offload.py`: vLLM's own demo model on the CPU, its KV cache planned (`get_kv_cache_configs`), allocated and bound by Model Runner V2's `init_attn_backend` / `init_kv_cache`: the arena exists after model build and the host pools after KV allocation, to the byte of `flashnext plan` (544,772 B and 113,770,496 B at 4 MB), no step allocates; `_run_qsa` with the metadata vLLM's `QSAIndexerMetadataBuilder` built (the layer's own `Qwen4ExpQSAMetadata` made from the compressed-key group's, its slots the host rows the block ids give), K/V stored by `Qwen4ExpQSAImpl.do_kv_cache_update` (vLLM's Triton writer for the CUDA op; the indexer, CUDA-only, stood in for) into those rows, attention (`OffloadedQSA.forward` in `impl.forward`'s place) against a torch reference for a staged prefill and a row-cache decode; the seed's per-rank arena split against the plan; `tests/serving/patches/test_qsa_offload_fused_writer.py`: the demo at the smallest dims that take vLLM's fused writer (an indexer head of 128, RoPE over 64 dims, the release's MRoPE sections), `QSAIndexer.forward`'s `qsa_prepare` launch through the Triton interpreter stores each token's K/V into exactly the host rows the offload's slots name, across a block boundary and beside a decode, the values bit for bit those of vLLM's unfused writer on the same inputs, the keys within 2 bf16 steps, no other row changed, and the offloaded attention reads them against a torch reference; the kernels in `tests/quant/kernels/test_qsa_row_cache.py`",
        coverage=Coverage(
            vllm_cpu="vLLM's demo model on CPU: patched Platform._align_hybrid_block_size, get_kv_cache_spec/get_kv_cache_configs, V2's init_attn_backend/init_kv_cache binding _QSAIndexerCache (host pool created), _run_qsa with QSAIndexerMetadataBuilder metadata (main Qwen4ExpQSAMetadata derived from the compressed-key group's), K/V stored by Qwen4ExpQSAImpl.do_kv_cache_update; at the fused writer's dims, QSAIndexer.forward with its qsa_prepare launch (K/V into the host rows), its Triton logits and index-expansion kernels, all under the Triton interpreter.",
            gpu="test_qsa_row_cache.py on the H200 (9 passed, rows pinned and read via UVA, incl. test_real_shapes_on_pinned_host_memory); benchmarks/qsa_offload.py (warm 1.76-9.2x all-VRAM, 1.3x target missed). Kernels only, not through vLLM.",
            stand_in="QSA indexer (CUDA-only) replaced by a random causal selection; vllm._custom_ops.reshape_and_cache_flash (needs vllm._C) by vLLM's Triton twin; quant config dropped, seeded weights, torch F.linear projection; hand-written block table; get_device_capability mocked (8,6); host rows unpinned. Fused writer: current_platform.is_cuda() reads True in the QSA module while the model is built (vLLM picks the unfused path off CUDA), torch.topk for the indexer's top-k (torch.ops._C.persistent_topk), the pool written directly (no UVA view on the CPU).",
            gap="The fused qsa_prepare writer at the release's own dims (main heads of 256, a quarter rotated) and through a real UVA view on a GPU never ran (the CPU test runs it at the demo's heads, in the interpreter). Also untested: the real indexer's top-k, CUDA-graph capture of attend, profile_cudagraph_memory's double bind, 262k prefill.",
        ),
    ),
    Patch(
        id="int8-modules", order=10, file="int8-modules.patch", seed=None,
        switch=EnvVar("VLLM_INT8_MODULES", "1", "Patch int8-modules: 0 builds qwen4_exp's embed_tokens, lm_head and hyper-connection mixers as vLLM 0.33.0 does, in bf16 (its loader then refuses the release's INT8 tensors)."),
        hooks=("flashnext.serving.hooks.int8_modules",),
        why_diff="qwen4_exp builds embed_tokens, lm_head and the hyper-connection mixers with no quantization config (quant_config=None), so a registered compressed-tensors config is never asked.",
        upstream="not upstream in 0.34.0 (verified: vLLM's own loader refuses the demo checkpoint's INT8 embed_tokens, and GatedResidual still builds its mixers with quant_config=None); drop when vLLM's qwen4_exp builds these layers with the checkpoint's quantization config.",
        seed_effect="the release's INT8 embed_tokens, lm_head and HC mixers load at all (0.60 GiB each for embed_tokens and lm_head as INT8, half of bf16; seed 000 §3.3, §6)",
        tests="`tests/serving/test_patch_series.py::test_int8_modules_load_and_serve_the_release_tensors`: vLLM's own demo model on the CPU and its own weight loader: stock refuses `embed_tokens.weight_packed` and fails on the mixers; patched, the embedding's rows equal the dequantized checkpoint rows exactly, the logits match the reference, and every mixer projection holds the checkpoint's words and computes its output; switch off: refused again; `tests/serving/patches/test_load_reallocation.py`: in vLLM's own post-load step each mixer projection allocates its words and scales once and frees the loaded ones, as a repack would (seed 000 §3.5); `tests/serving/patches/test_int8_lm_head.py`: built as a 3090 and an H200 would build it, the LM head gets the kernel vLLM's chooser picks (Marlin, Machete; flashnext's on the CPU and with `VLLM_INT8_LM_HEAD_KERNEL=flashnext`), and vLLM's scheme loads the checkpoint's words and computes the logits",
        coverage=Coverage(
            vllm_cpu="vLLM's demo model and its load_weights on CPU: VocabParallelEmbedding/ParallelLMHead get Int8EmbeddingMethod, hyper-connection MergedColumnParallelLinear/ReplicatedLinear get Int8LinearMethod; embedding rows exact, compute_logits within 2^-6 of reference; stock and switch-off refuse. At sm86/sm90 (chooser stand-in) the LM head holds vLLM's CompressedTensorsWNA16 scheme with Marlin/Machete, loads the checkpoint's words, and its batch-invariant route matches the reference.",
            gpu="flashnext's int8_mma only: test_decode_mma.py::test_int8_from_compressed_tensors_words (small shapes, in the H200 kernels run) and benchmarks/int6_vs_bf16.py --int8 at the LM head's shape (1.28x bf16, 1.10-1.15x Humming). Not through vLLM.",
            stand_in="quant config narrowed to INT8 groups with PLE key/value and indexer projections dropped (Marlin, no CPU kernel); int8_mma runs under Triton's CPU interpreter; 3-token inputs only; for the LM head at sm86/sm90, the CUDA platform as the chooser sees it and vLLM's batch-invariant dequantize + matmul in place of Marlin's repack and GEMM.",
            gap="The mixers' prefill path (>16 tokens) is not driven through vLLM; Marlin's/Machete's repack and GEMM of the LM head never ran here (CUDA ops); int8_mma never compiled or run on sm86; the full model's INT8 layers at PP=3 (embed on rank 0, LM head on rank 2) and inside captured decode graphs untested.",
        ),
    ),
    Patch(
        id="decode-04", order=11, file="decode-04.patch", seed="decode-04",
        switch=EnvVar("VLLM_HC_FUSED_DECODE", "1", "Patch decode-04: 0 runs a decode step's hyper-connection mix through vLLM's unfused GEMMs and hc_silu / hc_gate_mix kernels again."),
        hooks=("flashnext.serving.hooks.hc_decode.mix",),
        why_diff="GatedResidual.mix is a method of a class the model builds directly; no registry chooses it.",
        upstream="not upstream in 0.34.0 (verified: its fused HC kernels are bf16 only: the CuTe down+SiLU for sm90+ up to 48 tokens, and 0.34.0's new up+gate+mix, hc_up_gate_mix, for sm100 from 512 tokens); drop when vLLM fuses the INT8 mix.",
        seed_effect="GatedResidual 32 -> 13.3 us, about 1.8 ms per token on the 3090 (seed 000 §3.3)",
        tests="`tests/quant/kernels/test_hc_mix.py`: bit-identical to the unfused path in torch on exactly representable inputs (Triton interpreter; H200 at the real shapes, `-m gpu`); `tests/serving/test_patch_series.py::test_int8_modules_load_and_serve_the_release_tensors`: vLLM's own GatedResidual on the demo checkpoint gives the same block input and injection fused, unfused (switch off) and by the reference",
        coverage=Coverage(
            vllm_cpu="vLLM's own GatedResidual (hyperconnection.py) of the demo model, INT8 mixers loaded by vLLM's loader: patched mix()/combine_and_mix call hc_decode.mix for 1-16 tokens; fused output bit-identical to vLLM's unfused path (switch off) and to the torch reference.",
            gpu="tests/quant/kernels/test_hc_mix.py::test_real_shapes (m=1..16) on the H200 (in the 34-passed -m gpu run, 2026-12-01); benchmarks/decode_fusions.py: 12.9 us vs 17.7 us for the INT8 GEMMs alone. Kernel only, no vLLM.",
            stand_in="hc_mix and vLLM's unfused HC ops run under Triton's CPU interpreter; 3-token inputs; quant config narrowed to INT8 groups; on the H200 the unfused side is a torch model of vLLM's Triton kernels (Triton sigmoid, FMA).",
            gap="Never compiled or timed on sm86 (the seed's 32 -> 13.3 us is a 3090 figure, not reproduced); the fused mix inside vLLM's FULL_DECODE_ONLY capture and its bit-equality to vLLM's real GPU hc_silu/hc_gate_mix untested (1 of 10,240 elements differed at 4 tokens vs the model).",
        ),
    ),
    Patch(
        id="int6-bitplane", order=12, file=None, seed=None,
        switch=EnvVar("VLLM_INT6_BITPLANE", "1", "Patch int6-bitplane: 0 turns a bit-plane overlay's modules back into dense INT6 words at load and serves them with vLLM's own INT6 path."),
        hooks=("flashnext.serving.hooks.int6_bitplane.linear_method",),
        registers="flashnext.serving.quantization.compressed_tensors.register",
        probe=probes.int6_bitplane,
        upstream="not upstream (the bit-plane layout is flashnext's overlay); drop with the overlay. A plugin since 0.34.0: vLLM's register_quantization_config replaces compressed-tensors' config with flashnext's subclass, which only re-decides the linear layers vLLM gives CompressedTensorsLinearMethod.",
        seed_effect="the bit-plane layout of seed 000 §3.3 is served at all; there, the INT6 shared expert through it (gate_up + SiluAndMul in one kernel, down + the final sum in another) went 13.4 / 7.0 -> 7.8 / 5.3 us on the 3090; the layout is the seed's, the kernels are flashnext's (docs/benchmarks.md)",
        tests="`tests/serving/test_patch_series.py::test_int6_bitplane_overlay_is_served`: vLLM's own demo model on the CPU with the overlay applied: stock refuses the planes on shape; patched, the shared experts load the planes and their outputs match the original dense weights; switch off: the words are the original snapshot's again and vLLM's own INT6 path (batch-invariant mode on the CPU) gives the same outputs; `tests/serving/patches/test_no_new_triton_variants.py::test_int6_bitplane_layers_are_warmed_at_load`: the load-time launch covers every Triton variant of 1..16 tokens; `tests/serving/patches/test_load_reallocation.py`: in vLLM's own post-load step each bit-plane projection allocates its planes (one region of the dense words' size) and scales once and frees the loaded ones, as a repack would (seed 000 §3.5)",
        coverage=Coverage(
            vllm_cpu="Patched CompressedTensorsConfig.get_quant_method gives the demo's shared-expert MergedColumnParallelLinear/RowParallelLinear BitplaneLinearMethod; vLLM's loader loads the overlay's planes; gate_up output matches the dense weights; switch off: planes -> original words for CompressedTensorsWNA16.",
            gpu="Kernels only: test_bitplane_kernel.py::test_real_shapes_on_the_gpu / test_large_shape_on_the_gpu, test_decode_mma.py::test_real_shapes and test_prefill_gemm.py::test_real_shapes on the H200; benchmarks/int6_vs_bf16.py against stock's Humming: faster at the shared expert's shapes at 1-16 tokens, slower at every attention shape (which repack-int6 --targets refuses) and at 512-token prefill.",
            stand_in="quant config narrowed to the INT6 group on shared experts only (no CPU INT6 kernel elsewhere); kernels under the Triton interpreter; the switch-off layer is built alone under VLLM_BATCH_INVARIANT=1 and its INT6 GEMM (Marlin on a GPU) is not run; sm86 variants only as Triton cache keys.",
            gap="Load-time warm_bitplane_matmul inside vLLM's memory profiling, the speed of the bit-plane kernels on a 3090 (only their sm86 compile is checked), and the fallback's Marlin INT6 path at release shapes never run; no whole-model serve of the overlay view. Prefill through the tiled prefill GEMM is 1.5-2x slower than stock's Humming at 512 tokens on the H200 (docs/benchmarks.md).",
        ),
    ),
    Patch(
        id="decode-05", order=13, file="decode-05.patch", seed="decode-05",
        switch=EnvVar("VLLM_MOE_FUSED_DECODE", "1", "Patch decode-05: 0 routes a decode step's MoE block through vLLM's router GEMM, top-k and shared-expert gate again, and Marlin aligns its own blocks."),
        hooks=("flashnext.serving.hooks.moe_decode.forward", "flashnext.serving.hooks.moe_decode.merge_router_rows"),
        why_diff="Qwen4ExpSparseMoeBlock.forward and fused_marlin_moe's alignment call are inline; vLLM's MoE kernel selection chooses experts' kernels, not the router. The router rows' merge at load is the block's own process_weights_after_loading (vLLM's finalize_model_weights runs it for the model's and the MTP draft's blocks): the router and shared gate are built unquantized, so no quantization method flashnext registers sees them, and vit-stream's model-level hook is another patch's and misses the draft.",
        upstream="not upstream in 0.34.0 (verified: the router GEMM, the shared gate, topk_softmax and moe_align_block_size are still separate launches; router_factory is unchanged from 0.33.0); drop when vLLM fuses decode routing.",
        seed_effect="the small kernels around a one-token MoE block's experts on the 3090: router GEMV 12 us, topk_softmax 7 us (one CTA), moe_align_block_size 7 us (two kernels), the shared expert's gate 7 us (four kernels), now one launch (seed 000 §3.3; the seed gives no time for it; the H200's in docs/benchmarks.md). The seed's 13.4 / 7.0 -> 7.8 / 5.3 us is the INT6 bit-plane shared expert's kernels (patch int6-bitplane), which this hook calls",
        tests="`tests/serving/patches/test_decode05_router_rows_at_load.py`: vLLM's own model for the demo checkpoint and vLLM's own post-load step: every MoE block's router and shared-gate weights are views into one `[E + 1, H]` matrix right after it, and decode steps of 1 to 4 tokens allocate no new one; `tests/serving/test_patch_series.py::test_decode05_routes_vllms_moe_block_through_the_fused_router`: vLLM's own MoE block for the demo checkpoint on the CPU (plain, and with the bit-plane overlay's shared expert): the fused path for 1 to 4 tokens, the same experts, outputs within one bf16 step of vLLM's path, vLLM's router agreeing with the kernel given its logits, the switch off equal to stock; `tests/serving/patches/test_decode05_cuda_router.py::test_decode05_serves_vllms_cuda_router_and_declines_every_other`: the same block built with the router vLLM's factory builds on CUDA (`FusedTopKRouter`; `topk_softmax`, a CUDA op, stood in for): the fused path against the switch off, and every other router flavour declined without an exception; `tests/serving/patches/test_no_new_triton_variants.py`: the router's Triton cache keys at 1..4 tokens are those of the captured sizes; `tests/quant/kernels/test_moe_route.py` (router and alignment, interpreter and H200; the alignment's sizes and contents against vLLM's own `moe_align_block_size`, its CUDA op stood in for)",
        coverage=Coverage(
            vllm_cpu="vLLM's own Qwen4ExpSparseMoeBlock for the demo (patched forward and post-load hook), FusedMoE built by vLLM's FusedMoEFactory, RoutedExperts.forward_modular and vLLM's router (CPURouter; FusedTopKRouter from router_factory under a CUDA platform enum): fused path at 1-4 tokens, same experts, select_experts agrees; vLLM's process_weights_after_loading over the whole demo model merges every block's router rows; vLLM's moe_align_block_size Python sizes the buffers the fused alignment matches.",
            gpu="flashnext's route kernel only: tests/quant/kernels/test_moe_route.py::test_real_shape (m=1,2,4, with alignment) on the H200, and (issue 40) the alignment at vLLM's sizes against reference_align for 4/8/64/512 experts, blocks 8-64, 1-4 tokens (80 cases); benchmarks/decode_fusions.py (6.1 us fused vs 9.7 us GEMMs alone). Marlin never run.",
            stand_in="routed experts' kernel (quant_method.apply) replaced by a torch loop (no CPU MoE kernels); topk_softmax (CUDA op) by its arithmetic; moe_align_block_size's CUDA op (_moe_C) by its kernel's fill (reference_align), into the buffers vLLM's Python allocates; experts bf16 (quant config deleted), so the Marlin alignment hand-off is only unit-tested via alignment_for; Triton interpreter.",
            gap="The patched fused_marlin_moe taking route's alignment instead of moe_align_block_size never ran anywhere, nor vLLM's CUDA alignment op itself; INT4 Marlin experts, CUDA-graph capture of the 1/2/4-token path, the router rows' merge on a GPU under vLLM's memory profiler, sm86 timing untested.",
        ),
    ),
    Patch(
        id="vit-stream", order=14, file="vit-stream.patch", seed=None,
        switch=EnvVar("VLLM_VIT_STREAM", "1", "Patch vit-stream: 0 keeps the vision tower's blocks resident in device memory."),
        hooks=("flashnext.serving.hooks.vit_stream.install",),
        why_diff="the tower is built inside the model's __init__, which the build context must wrap; a registered model subclass could take the post-load half only.",
        upstream="not upstream in 0.34.0 (verified: the tower's weights are resident parameters unless the UVA offloader, the only one that takes towers, has the GPU read them over PCIe at every use; the prefetching offloader takes only the decoder layers); drop when vLLM offloads encoder weights with prefetch.",
        seed_effect="images beside 783 MB of K/V on the first rank: 2 x 29 MiB slots, 1.16 ms a block, 2 MP TTFT 0.85 s, 45 of 45 image requests answered (seed 000 §6)",
        tests="`tests/serving/test_patch_series.py::test_vit_stream_runs_vllms_tower_from_two_slots`: vLLM's own vision tower for the demo checkpoint (5 blocks) on the CPU: stock keeps 60 parameter storages; patched, the post-load hook moves them into one two-slot buffer and three runs of the same two images in a row give the resident tower's output bit for bit; the switch off keeps it resident. `tests/serving/hooks/test_vit_stream.py` (H200: a tower built on the CPU streams on the GPU); `benchmarks/vit_stream.py`: overlap on the H200",
        coverage=Coverage(
            vllm_cpu="vLLM's own Qwen3_VisionTransformer (5 blocks) built by the demo model under vit_stream.build_context(); the patched model-level process_weights_after_loading installs BlockStream; three runs of two images bit-identical to the resident tower; switch off stays resident. tests/serving/test_engine_ledger_vision.py: images through Model Runner V2's own EncoderRunner.execute_mm_encoder after vLLM's post-load step, the slots and host rows the ledger's entries, nothing of vit-stream's allocated per image.",
            gpu="tests/serving/hooks/test_vit_stream.py -m gpu passed on the H200 (plain torch LayerNorm/Linear blocks, side-stream copies); benchmarks/vit_stream.py: 27 synthetic torch blocks, 784.8 -> 58.1 MiB, copies hidden from 2048 patches. Not vLLM's tower.",
            stand_in="quant config dropped, seeded weights; qwen3_vl.HAS_TRITON=False (pure-torch position interpolation); finish_layers sets vLLM's _cpu_skip_gemm_dispatch (vllm._C convert_weight_packed absent) -> F.linear; the scenario calls model.process_weights_after_loading() itself; no pinning or copy stream.",
            gap="Never run: vLLM's loader on a CUDA target with a CPU-built tower (device_loading_context), vLLM's GPU encoder attention over 27 streamed blocks, the encoder profile run, rank 0 avoiding the Marlin-repack OOM, and 2 MP TTFT over a 3090's PCIe 4.0.",
        ),
    ),
    Patch(
        id="step-time", order=15, file="step-time.patch", seed=None,
        switch=EnvVar("VLLM_GPU_STEP_TIME", "0", "Patch step-time: 1 times every CUDA graph replay (a decode step) with CUDA events, without a sync, and serves the times on /metrics as flashnext:gpu_step_seconds per rank (what `flashnext bench` shows)."), switch_off="0",
        hooks=("flashnext.serving.hooks.step_time.replay", "flashnext.serving.hooks.step_time.register_collector",),
        why_diff="CudaGraphManager.run_fullgraph replays inline with no hook around a replay, and the /metrics collector is registered by the API server's attach_router.",
        upstream="not upstream in 0.34.0 (verified: StepTimingCollector in v1/worker/gpu/async_utils.py times forward steps only inside collect(), the adaptive-verification profiling at startup, and synchronizes when it ends; VLLM_LOG_BATCHSIZE_INTERVAL syncs and logs); drop when vLLM exposes per-step GPU time on /metrics.",
        seed_effect="none of its own (off by default): it is seed 000 §3.0's measure, GPU time from CUDA events around the graph replay, taken because the torch profiler summed 12.15 ms of FULL-cudagraph kernels against a real ITL of 10.66 ms",
        tests="`tests/serving/patches/test_step_time_patch.py::test_vllms_replay_is_timed_per_pipeline_rank_and_served_on_metrics`: vLLM's own `CudaGraphManager.run_fullgraph` on two gloo pipeline ranks (a stand-in graph and stand-in events, no CUDA here), then vLLM's own `attach_router` serving `/metrics`: each rank's step times in `flashnext:gpu_step_seconds`, read by `flashnext bench`'s parser; stock and the switch off: replayed, nothing timed or served; `tests/serving/hooks/test_step_time.py` (the recorder never synchronizes and reads a pair only once completed; H200: a real CUDA graph timed by real events, `-m gpu`)",
        coverage=Coverage(
            vllm_cpu="vLLM's own CudaGraphManager.run_fullgraph (patched; ModelCudaGraphManager's on top) on two gloo PP ranks with vLLM's parallel groups for the rank labels; vLLM's attach_router (patched) on a FastAPI app, /metrics fetched through Starlette's TestClient from vLLM's get_prometheus_registry.",
            gpu="tests/serving/hooks/test_step_time.py::test_a_real_cuda_graph_is_timed_without_a_sync -m gpu (torch.cuda.CUDAGraph and timing events, no vLLM); not yet run on the H200.",
            stand_in="the CUDA graph is an object with replay() that advances a stand-in GPU clock; torch.cuda.Event is replaced by an event whose query() is true once a later replay was launched (the GPU one step behind) and whose synchronize() raises; managers are made with __new__ and given graphs (their __init__ needs a CUDA VllmConfig).",
            gap="Never run: a vLLM serve with the switch on (the engine core's workers and the API server as separate processes), real FULL_DECODE_ONLY replays on a 3090 or H200 and their event overhead, V1's CUDAGraphWrapper (not patched: the profiles run V2), multi-node PP (ranks on other hosts are not seen).",
        ),
    ),
)


ABSORBED: tuple[Absorbed, ...] = (
    Absorbed(
        id="mtp-03", seed="mtp-03", since="0.34.0",
        fixed_by="vllm/v1/worker/gpu/spec_decode/utils.py: DraftTokensHandler keeps the latest drafts per live request (_draft_tokens_by_req), begin_step() notes which requests the step's deferred grammar bitmask needs, get_draft_tokens() returns those, discard() forgets a finished one",
        probe=probes.upstream_mtp_03,
        seed_effect="2 concurrent: 9 of 16 structured requests failed before, 45 of 45 succeeded after; acceptance rate unchanged (§8)",
        tests="`tests/serving/patches/test_absorbed_upstream.py::test_mtp03_drafts_survive_alternating_pp_batches_on_stock`: seed 000 §8's two structured requests alternating batches under PP=2 through 0.34.0's own DraftTokensHandler and the scheduler's deferred-bitmask path: every lookup finds its request's drafts",
    ),
    Absorbed(
        id="pp-ple", seed=None, since="0.34.0",
        fixed_by="vllm/model_executor/models/config.py and vllm/models/qwen4_exp/nvidia/model_state.py no longer refuse pipeline_parallel_size > 1 for the PLE model; vllm/v1/core/kv_cache_planning.py projects a uniform-type group's specs onto the worker's own layer names",
        probe=probes.upstream_pp_ple,
        seed_effect="makes the seed's PP3 system start at all (seed 000 §10)",
        tests="`tests/serving/patches/test_absorbed_upstream.py::test_pp_ple_stock_accepts_pp3_and_plans_each_ranks_own_layers`: vLLM's own `VllmConfig` on the demo checkpoint at PP=3 accepted by stock 0.34.0, and rank 1 of the 3x3090 layout through vLLM's `get_kv_cache_config_from_groups` and `allocate_kv_cache`: a view for every layer of the rank",
    ),
    Absorbed(
        id="mem-01", seed="mem-01", since="0.34.0",
        fixed_by="vllm/models/qwen4_exp/nvidia/model.py: Qwen4ExpModel builds embed_tokens on the first pipeline rank only and Qwen4ExpForCausalLM its lm_head on the last only (PPMissingLayer elsewhere)",
        probe=probes.upstream_mem_01,
        seed_effect="weights per rank [21.58, 21.55, 21.55] -> [20.98, 20.44, 21.05] GiB, 2.2 GiB freed, which lets 16/17/15 and the MTP head fit (§6; the split and the MTP head's fit: §7)",
        tests="`tests/serving/patches/test_draft_head_under_pp.py::test_mem01_embed_on_the_first_rank_and_lm_head_on_the_last`: stock 0.34.0's `Qwen4ExpForConditionalGeneration` for the demo checkpoint on two gloo ranks: the INT8 embedding on rank 0 only and the LM head on rank 1 only",
    ),
    Absorbed(
        id="mtp-01 (the draft's branch)", seed="mtp-01", since="0.34.0",
        fixed_by="vllm/models/qwen4_exp/nvidia/mtp.py: Qwen4ExpMultiTokenPredictor.forward branches on its inputs, not on the global first rank, so the drafter built on the last stage embeds (mtp-01 keeps only the INT8 embedding)",
        probe=probes.upstream_mtp_01_branch,
        seed_effect="MTP under PP at all: stock failed at startup (§7)",
        tests="`tests/serving/patches/test_draft_head_under_pp.py`: vLLM's own `Qwen4ExpMTP` made by `load_eagle_model` on the last of two gloo ranks embeds and runs its forward",
    ),
)
