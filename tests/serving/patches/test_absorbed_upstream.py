"""What vLLM 0.34.0 fixed upstream, so that the series dropped the patches (``ABSORBED`` in
serving/patches/series.py): each seed case run on stock 0.34.0's own code on the CPU, and each
absorbed patch's probe of upstream's fix. And issue 39's third item: whether 0.34.0's mamba
spec-decode state copies on a non-last pipeline rank land in each request's own blocks.

Each scenario runs in its own interpreter and says, where it stands in for something, what and why.
"""

import textwrap

import pytest

from support import free_port, run_scenario

from flashnext.serving.patch_series import _run_probes, installed_vllm_root
from flashnext.serving.patches.series import ABSORBED

pytestmark = pytest.mark.slow  # minutes in all on 2 cores: tests/conftest.py sends it to a worker first

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}


def test_every_absorbed_probe_passes_on_stock_vllm(tmp_path):
    """The probes run as `flashnext patches check` runs them (serving/patch_series.py's runner): in one
    fresh interpreter that imports the installed vLLM, here stock 0.34.0, with no patch applied."""
    assert {a.id for a in ABSORBED} == {"mtp-03", "pp-ple", "mem-01", "mtp-01 (the draft's branch)"}
    assert _run_probes(list(ABSORBED), installed_vllm_root().resolve(), tmp_path) == {}


# --- mtp-03: structured output under MTP + PP=2 (seed 000 §8) ---------------------------------------

MTP03_SCENARIO = textwrap.dedent('''
    import json, os, queue, sys, time
    from collections import deque
    import torch

    import support.no_cuda
    support.no_cuda.install()

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                             StructuredOutputsConfig, VllmConfig)
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

    snapshot, model_dir = sys.argv[1], sys.argv[2]
    # The demo checkpoint (its files linked) with a tokenizer of five tokens beside it: structured
    # output needs one, and the demo has none.
    VOCAB = {"<eos>": 0, "<unk>": 1, "a": 2, "b": 3, "x": 4}
    os.makedirs(model_dir)
    for name in os.listdir(snapshot):
        os.symlink(os.path.join(snapshot, name), os.path.join(model_dir, name))
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>").save_pretrained(model_dir)

    # The 3x3090+MTP serve's shape at PP=2: MTP with one draft token, xgrammar, async scheduling.
    model = ModelConfig(model=model_dir, max_model_len=256, dtype="bfloat16",
                        limit_mm_per_prompt={"image": 0, "video": 0})
    parallel = ParallelConfig(pipeline_parallel_size=2)
    config = VllmConfig(
        model_config=model, parallel_config=parallel, cache_config=CacheConfig(block_size=32),
        speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model,
                                             target_parallel_config=parallel),
        scheduler_config=SchedulerConfig(max_model_len=256, is_encoder_decoder=False, max_num_seqs=8,
                                         max_num_batched_tokens=256),
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"))
    # vLLM's CPU platform turns async scheduling off; the rig's CUDA platform keeps its default, on,
    # and the seed's failure needs it (the deferred grammar bitmask is async scheduling's)
    config.scheduler_config.async_scheduling = True
    assert config.max_concurrent_batches == 3  # the engine's batch queue: a batch per stage, and one more

    # One full-attention group for the demo's layers, planned by vLLM's own planner (the draft-token
    # path never reads the KV cache), and the layout the engine core resolves once.
    config.cache_config.kv_cache_layout = "BLHNC"
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = get_kv_cache_groups(config, {f"model.layers.{i}.self_attn": spec for i in range(2)})
    kv_cache_config = get_kv_cache_config_from_groups(config, groups, 2 * 64 * spec.page_size_bytes)
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks  # as EngineCore records it

    GRAMMARS = ("(ab)+", "(ba)+")
    MAX_TOKENS = 8


    def answer(req_id: str) -> list[int]:
        """What the model means to say for a request: what its grammar accepts."""
        first, second = ("a", "b") if int(req_id) % 2 == 0 else ("b", "a")
        return [VOCAB[first], VOCAB[second]] * (MAX_TOKENS // 2)


    def allowed(bitmask, row: int, token: int) -> bool:
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


    class LastRank:
        """The last pipeline rank's GPUModelRunner, as far as draft tokens go. Its DraftTokensHandler
        is vLLM's own, called where model_runner.py calls it: begin_step and (_remove_request's)
        discard in execute_model, set_draft_tokens after drafting, get_draft_tokens in
        take_draft_token_ids. Stand-ins for what runs on the GPU: the forward and rejection sampler
        (the model's first choice is always "x", which neither grammar accepts, its second the
        request's answer: only the grammar bitmask keeps it on its answer; a draft is accepted when
        it is the masked choice), and the MTP drafter (it proposes the answer's next token)."""

        def __init__(self, handler_class):
            self.handler = handler_class(torch.device("cpu"))
            self.buffers = InputBuffers(8, 64, torch.device("cpu"))
            self.gpu_drafts = {}  # req_states.draft_tokens: what each request's next step verifies
            self.generated = {}
            self.scheduled = None  # the executed step whose sampling is to come
            self.latest_drafted = []  # the requests of the latest set_draft_tokens
            self.lookups = []  # (request, its drafts as looked up, the GPU's, drafted in the latest batch)
            self.bitmask_drafts = []  # (request, the scheduler's drafts for its bitmask, the GPU's)
            self.scheduled_placeholders = 0  # draft slots the scheduler scheduled as -1 (async scheduling)

        def execute_model(self, scheduler_output):
            self.scheduled_placeholders += sum(
                slots == [-1] for slots in scheduler_output.scheduled_spec_decode_tokens.values())
            self.handler.begin_step(scheduler_output)
            for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
                self.handler.discard(req_id)
                self.gpu_drafts.pop(req_id, None)
            if scheduler_output.total_num_scheduled_tokens == 0:
                return EMPTY_MODEL_RUNNER_OUTPUT
            self.scheduled = scheduler_output
            return None  # the step's output comes from sample_tokens

        def take_draft_token_ids(self):
            got = self.handler.get_draft_tokens()
            found = dict(zip(got.req_ids, got.draft_token_ids))
            for req_id in self.scheduled.scheduled_spec_decode_tokens:
                if req_id in self.gpu_drafts:
                    self.lookups.append((req_id, found.get(req_id), [self.gpu_drafts[req_id]],
                                         req_id in self.latest_drafted))
            return got

        def sample_tokens(self, grammar_output):
            step, self.scheduled = self.scheduled, None
            req_ids = list(step.num_scheduled_tokens)
            rows = {} if grammar_output is None else {
                r: 2 * i for i, r in enumerate(grammar_output.structured_output_request_ids)}
            sampled = []
            for req_id in req_ids:
                def choice(position):  # position 0: the draft's (or the first token's), 1: the bonus
                    ranking = [VOCAB["x"], answer(req_id)[(self.generated.get(req_id, 0) + position) % MAX_TOKENS]]
                    if req_id not in rows:
                        return ranking[0]
                    mask = grammar_output.grammar_bitmask
                    return next(t for t in ranking if allowed(mask, rows[req_id] + position, t))
                tokens = [choice(0)]
                if step.scheduled_spec_decode_tokens.get(req_id) and req_id in self.gpu_drafts:
                    self.bitmask_drafts.append((req_id, list(step.scheduled_spec_decode_tokens[req_id]),
                                                [self.gpu_drafts[req_id]]))
                    if self.gpu_drafts[req_id] == tokens[0]:
                        tokens.append(choice(1))
                sampled.append(tokens)
                self.generated[req_id] = self.generated.get(req_id, 0) + len(tokens)
            drafts = [[answer(r)[self.generated[r] % MAX_TOKENS]] for r in req_ids]
            self.gpu_drafts.update((r, d[0]) for r, d in zip(req_ids, drafts))
            batch = InputBatch.make_dummy(len(req_ids), len(req_ids), self.buffers)
            batch.req_ids, batch.has_structured_output_reqs = req_ids, step.has_structured_output_requests
            self.handler.set_draft_tokens(batch, torch.tensor(drafts))
            self.latest_drafted = req_ids
            return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


    class OneBatchDraftTokens(DraftTokensHandler):
        """0.33.0's handler, for the control: the latest sampled batch's drafts only."""

        def set_draft_tokens(self, input_batch, draft_tokens):
            self._draft_tokens_by_req.clear()
            super().set_draft_tokens(input_batch, draft_tokens)


    def serve(handler_class, num_requests=16, concurrent=2):
        """16 structured requests, 2 at a time, through vLLM's own engine core step with the batch
        queue (step_with_batch_queue), AsyncScheduler, StructuredOutputManager (xgrammar) and
        UniProcExecutor (each RPC runs when sent, in the order sent, as each pipeline worker runs its
        queue). The second client arrives a step after the first and the scheduler decodes a
        request every second step (PP=2), so the two alternate batches."""
        manager = StructuredOutputManager(config)
        core = EngineCore.__new__(EngineCore)  # its __init__ starts workers and profiles the model
        core.vllm_config, core.log_stats, core._weight_version = config, False, "default"
        core.structured_output_manager = manager
        core.scheduler = config.scheduler_config.get_scheduler_cls()(
            vllm_config=config, kv_cache_config=kv_cache_config, structured_output_manager=manager,
            block_size=32, log_stats=False)
        core.model_executor = UniProcExecutor.__new__(UniProcExecutor)  # its __init__ starts a worker
        core.model_executor.driver_worker = rank = LastRank(handler_class)
        core.batch_queue_size = config.max_concurrent_batches
        core.batch_queue = deque(maxlen=core.batch_queue_size)
        core.is_mm_encoder_only = core.is_pooling_model = False
        core.check_for_draft_tokens = core.async_scheduling = True
        core.aborts_queue = queue.Queue()
        texts, finished, submitted = {}, {}, 0
        for step in range(200):
            live = submitted - len(finished)
            if submitted < num_requests and live < concurrent:  # one arrival a step at most
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=
                                        StructuredOutputsParams(regex=GRAMMARS[submitted % 2]))
                # what the frontend's InputProcessor and EngineCore.preprocess_add_request do
                params.verify(config.model_config, config.speculative_config, config.structured_outputs_config,
                              manager.tokenizer)
                request = Request.from_engine_core_request(EngineCoreRequest(
                    request_id=str(submitted), prompt_token_ids=[2, 3, 2, 3], mm_features=None,
                    sampling_params=params, pooling_params=None, arrival_time=time.time(), lora_request=None,
                    cache_salt=None, data_parallel_rank=None), None)
                manager.grammar_init(request)
                # compiled before it reaches the engine: the engine's steps, not the compiling
                # thread's speed, decide which batch it joins
                while not request.structured_output_request.is_grammar_ready:
                    time.sleep(0.01)
                core.add_request(request)
                submitted += 1
            outputs, _ = core.step_with_batch_queue()
            for engine_outputs in (outputs or {}).values():
                for out in engine_outputs.outputs:
                    texts.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.finish_reason is not None:
                        finished[out.request_id] = str(out.finish_reason)
            if len(finished) == num_requests:
                break
        manager.clear_backend()
        return {
            "finished": sorted(finished.values()),
            "right_text": sum(texts[r] == answer(r) for r in finished),
            "lookups": len(rank.lookups),
            "found": sum(got == want for _, got, want, _ in rank.lookups),
            "drafted_in_an_earlier_batch": sum(not latest for *_, latest in rank.lookups),
            "scheduled_placeholders": rank.scheduled_placeholders,
            "bitmask_steps": len(rank.bitmask_drafts),
            "bitmask_had_the_drafts": sum(seen == want for _, seen, want in rank.bitmask_drafts),
        }


    print(json.dumps({"stock": serve(DraftTokensHandler), "one_batch": serve(OneBatchDraftTokens)}))
''')


def test_mtp03_drafts_survive_alternating_pp_batches_on_stock(demo_snapshot, tmp_path):
    """Seed 000 §8 on stock vLLM 0.34.0: under PP=2 two structured requests alternate batches, so
    when the engine builds a batch's deferred grammar bitmask (EngineCore.step_with_batch_queue:
    take_draft_token_ids, then Scheduler.update_draft_token_ids_in_output and get_grammar_bitmask),
    the latest sampled batch is the other request's. 0.34.0's DraftTokensHandler keeps each live
    request's drafts and begin_step notes the batch's requests: every lookup finds its own."""
    got = run_scenario(MTP03_SCENARIO, (str(demo_snapshot), str(tmp_path / "model")), None, CPU_ENV)
    stock = got["stock"]
    assert stock["finished"] == ["length"] * 16 and stock["right_text"] == 16  # no request fails
    # each request's 4 verifying steps; every lookup is for a request the latest batch did not draft
    # (the seed's case), and finds its drafts
    assert stock["lookups"] == stock["drafted_in_an_earlier_batch"] == stock["found"] == 64
    # the scheduler scheduled each draft slot as a placeholder, and update_draft_token_ids_in_output
    # put in the drafts the GPU then verified before get_grammar_bitmask built the bitmask
    assert stock["scheduled_placeholders"] == stock["bitmask_steps"] == stock["bitmask_had_the_drafts"] == 64
    # The control, 0.33.0's one-batch drafts in the same engine: every lookup misses and each request
    # ends in the seed's HTTP 500 (the grammar rejects a bonus token sampled without its mask; seed
    # 000 §8 saw 9 of 16 at 2 concurrent, with a real serve's arrivals)
    control = got["one_batch"]
    assert control["finished"] == ["error"] * 16 and control["found"] == 0 < control["lookups"]


# --- pp-ple: the PLE model under PP=3 (seed 000 §10) --------------------------------------------

PP_PLE_SCENARIO = textwrap.dedent('''
    import json, sys
    import torch
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.worker.utils import allocate_kv_cache
    from flashnext.serving import capacity
    from flashnext.serving.profiles import load_profile

    out = {}
    # vLLM's own config hooks on the demo checkpoint's qwen4_exp config at PP=3
    model = ModelConfig(model=sys.argv[1], max_model_len=4096, skip_tokenizer_init=True)
    try:
        VllmConfig(model_config=model, parallel_config=ParallelConfig(pipeline_parallel_size=3))
        out["config"] = "accepted"
    except NotImplementedError as error:
        out["config"] = str(error)
    # The 3x3090 layout: every rank's layer specs (flashnext plan's model of each worker's
    # get_kv_cache_spec), grouped by vLLM's get_kv_cache_groups and projected onto each worker by
    # vLLM's _project_kv_cache_groups_to_worker. Rank 1 holds no layer of the PLE short-conv group.
    available = 20 * 3207168
    shape = capacity.ServingShape.from_profile(load_profile("3x3090"), available, True)
    layout = capacity.kv_cache_layout(capacity.load_text_config(), shape)
    out["empty_groups"] = [sum(not g.layer_names for g in groups) for groups in layout.projected]
    out["views"] = []
    for rank, groups in enumerate(layout.projected):
        config = get_kv_cache_config_from_groups(layout.vllm_config, groups, available)
        views = allocate_kv_cache(config, torch.device("cpu"),
                                  layout.vllm_config.cache_config.get_resolved_kv_cache_layout())
        out["views"].append(sorted(views) == sorted(layout.rank_specs[rank]))
    print(json.dumps(out))
''')


def test_pp_ple_stock_accepts_pp3_and_plans_each_ranks_own_layers(demo_snapshot):
    """Stock vLLM 0.34.0 accepts the PLE model at PP=3 (0.33.0 refused it), and plans each rank's KV
    cache from the rank's own layers: 0.33.0 kept a uniform-type group's whole-model specs on a rank
    holding none of its layers, so rank 1's allocate_kv_cache died in StopIteration."""
    got = run_scenario(PP_PLE_SCENARIO, (str(demo_snapshot),), None, CPU_ENV)
    assert got["config"] == "accepted"
    assert got["empty_groups"][1] >= 1  # the seed's case: a group rank 1 holds no layer of
    assert got["views"] == [True, True, True]  # a view for every layer of each rank, and no other


# --- issue 39 item 3: mamba spec-decode state under PP (a peer's PP3+MTP+prefix-caching fix) -------

MAMBA_PP_SCENARIO = textwrap.dedent('''
    import dataclasses, json, sys
    from collections import deque
    import numpy as np
    import torch
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig,
                             VllmConfig, set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState
    from vllm.v1.worker.gpu.pp_utils import PendingRecv, PPHandler
    from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

    snapshot, port = sys.argv[1], sys.argv[2]
    CPU = torch.device("cpu")
    # The CPU platform reports UVA, but pinning host memory needs the CUDA driver this machine lacks:
    # vLLM's own explicit-copy fallback for the block tables' staging buffers instead.
    buffer_utils.is_uva_available = lambda: False


    class NoCuda:  # the CUDA event PPHandler waits on: the CUDA runtime is what this machine lacks
        def wait_event(self, event): pass


    def bf16(hf_config):  # the GDN projections' INT6 words have no CPU kernel; no weight is used here
        if hasattr(hf_config, "quantization_config"):  # (vLLM first calls this on an empty config)
            del hf_config.quantization_config
        return hf_config


    # The PP3+MTP+prefix-caching serve's mamba settings: align mode, one draft token.
    model = ModelConfig(model=snapshot, max_model_len=256, dtype="bfloat16", skip_tokenizer_init=True,
                        hf_overrides=bf16, limit_mm_per_prompt={"image": 0, "video": 0})
    parallel = ParallelConfig()
    config = VllmConfig(
        model_config=model, parallel_config=parallel,
        cache_config=CacheConfig(enable_prefix_caching=True, mamba_cache_mode="align"),
        speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model,
                                             target_parallel_config=parallel),
        scheduler_config=SchedulerConfig(max_model_len=256, is_encoder_decoder=False, max_num_seqs=4,
                                         max_num_batched_tokens=256))
    config.cache_config.kv_cache_layout = "BLHNC"  # what the engine core resolves once
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:" + port,
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        # the demo's first two layers' gated delta nets, as a first pipeline rank holds them
        names = [f"model.layers.{i}.linear_attn" for i in (0, 1)]
        layers = [QwenGatedDeltaNetAttention(config.model_config.hf_text_config, vllm_config=config, prefix=name,
                                             gqa_interleaved_layout=False) for name in names]
        forward_context = config.compilation_config.static_forward_context
        specs = {name: forward_context[name].get_kv_cache_spec(config) for name in names}
        groups = get_kv_cache_groups(config, specs)
        page = groups[0].kv_cache_spec.page_size_bytes
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, 16 * len(names) * page)
        block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        init_kv_cache(forward_context, kv_cache_config, CPU, block_sizes, config)  # binds each layer's states
        tables = BlockTables(block_sizes=block_sizes, max_num_reqs=4, max_num_batched_tokens=64,
                             max_num_blocks_per_group=[8] * len(block_sizes), device=CPU)
        # The model's state for hybrid models; it reads of the model only its class's state copy
        # functions (get_mamba_state_copy_funcs), so the class stands in for a built model.
        state = MambaHybridModelState(config, Qwen4ExpForConditionalGeneration, None, CPU)
        state.initialize_kv_cache(kv_cache_config, tables)
    stock_ctx = state._mamba_ctx  # as initialize_kv_cache made it
    mamba_block_size = config.cache_config.mamba_block_size

    A, B, C = 0, 1, 2  # request state slots
    ROWS = {A: [1, 2, 3, 4], B: [5, 6, 7, 8], C: [9, 10, 11, 12]}  # each request's mamba blocks
    for slot, blocks in ROWS.items():
        tables.append_block_ids(slot, (blocks,), overwrite=True)
    tables.apply_staged_writes()
    buffers = InputBuffers(4, 64, CPU)
    num_computed = torch.zeros(4, dtype=torch.int32)  # req_states.num_computed_tokens, by slot


    def states():
        return [[s.clone() for s in layer.kv_cache] for layer in layers]


    def written(before, after):
        return sorted({b for old, new in zip(before, after) for so, sn in zip(old, new)
                       for b in range(so.shape[0]) if not torch.equal(so[b], sn[b])})


    def step(slots, marker):
        """One step of a pipeline rank for `slots`, in batch order, each with one draft token:
        vLLM's gather of the batch's block tables (model_runner.py prepare_attn), its mamba pre-copy
        (preprocess_state), then the forward writing each request's new recurrent state into its
        running block (a stand-in for the GDN kernels: the value marker + slot)."""
        batch = InputBatch.make_dummy(len(slots), 2 * len(slots), buffers)
        batch = dataclasses.replace(batch, idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots))
        gathered = tables.gather_block_tables(batch.idx_mapping, num_reqs_padded=len(slots),
                                              num_computed_tokens=num_computed)
        state.preprocess_state(batch, gathered, kv_cache_config, num_computed)
        for slot in slots:
            running = ROWS[slot][int(state._mamba_state_idx_gpu[slot])]
            for layer in layers:
                for s in layer.kv_cache:
                    s[running].fill_(marker + slot)
        return batch


    def sampled(slots, counts):
        """What post_update leaves for postprocess_state: each slot's computed tokens advanced by
        its sampled ones (1: the draft rejected, 2: accepted)."""
        for slot, n in zip(slots, counts):
            num_computed[slot] += n
        return torch.tensor(counts, dtype=torch.int32)


    def postprocess(idx_mapping, num_sampled):
        before = states()
        state.postprocess_state(idx_mapping, num_sampled, num_computed)
        return written(before, states())


    def run(timing, ctx=None, order=(A, B)):
        """Step T decodes A and B, each crossing a mamba block boundary (A's draft accepted, B's
        not); step T+1 decodes C alone; step T+2 decodes A and B again, in `order`. `timing`
        "last": step T's postprocess runs at once (the last rank samples); "non-last": at the start
        of step T+2 (update_pp_decode_requests), with the batch mapping PPHandler kept from step T,
        after step T+1 re-gathered the batch-ordered tables for C (a non-last rank at PP=2)."""
        for li, layer in enumerate(layers):  # every block's states hold values of their own
            for si, s in enumerate(layer.kv_cache):
                for b in range(s.shape[0]):
                    s[b].copy_(torch.arange(s[b].numel()).view(s[b].shape) + 1000 * b + 100 * li + 10 * si)
        state.num_accepted_tokens_gpu.fill_(1)
        state._mamba_ctx = ctx or stock_ctx
        num_computed[:] = torch.tensor([63, 127, 10, 0])
        for slot in (A, B, C):  # as add_request seeds it from the resumed position
            state._mamba_state_idx_gpu[slot] = (int(num_computed[slot]) - 1) // mamba_block_size
        pp = PPHandler.__new__(PPHandler)  # its __init__ makes a CUDA stream and an NCCL group
        pp.queue, pp.req_idx_gen_np = deque([None, None]), np.zeros(4, np.int32)
        pp.main_stream, pp.device = NoCuda(), CPU
        postprocessed = None

        assert pp.get_prev_sampled_outputs() is None  # step T takes step T-2's slot
        batch = step([A, B], 100)
        num_sampled = sampled([A, B], [2, 1])
        # what PPHandler.receive keeps of step T (its broadcasts from the last rank are NCCL's)
        pp.queue[-1] = PendingRecv(NoCuda(), torch.zeros(2, 2, dtype=torch.int64), num_sampled,
                                   torch.tensor([0, 1], dtype=torch.int32), batch.idx_mapping, batch.idx_mapping_np,
                                   np.ones(2, dtype=bool), pp.req_idx_gen_np[batch.idx_mapping_np].copy())
        if timing == "last":
            postprocessed = postprocess(batch.idx_mapping, num_sampled)
        assert pp.get_prev_sampled_outputs() is None  # step T+1 takes step T-1's slot
        step([C], 200)
        sampled([C], [1])
        kept = pp.get_prev_sampled_outputs()  # step T+2 takes step T's slot
        if timing == "non-last":
            assert kept["idx_mapping"].tolist() == [A, B] and tables.input_block_tables[0][0].tolist()[:4] == ROWS[C]
            postprocessed = postprocess(kept["idx_mapping"], kept["num_sampled"])
        step(list(order), 300)
        return postprocessed, states()


    last_written, last_states = run("last")
    non_last_written, non_last_states = run("non-last")
    _, reordered_states = run("non-last", order=(B, A))
    # What the fix described would repair: the copies reading the gathered, batch-ordered tables.
    gathered_ctx = MambaSpecDecodeGPUContext.create(
        max_num_reqs=state.max_num_reqs, kv_cache_config=kv_cache_config, copy_funcs=state._mamba_state_copy_funcs,
        forward_context=forward_context, device=CPU)
    gathered_ctx.initialize_from_forward_context(kv_cache_config, forward_context, state._mamba_state_copy_funcs,
                                                 list(tables.input_block_tables), list(tables.input_block_tables))
    gathered_written, gathered_states = run("non-last", ctx=gathered_ctx)
    same = lambda x, y: all(torch.equal(a, b) for la, lb in zip(x, y) for a, b in zip(la, lb))
    print(json.dumps({
        "copies_read": "per-request-slot" if stock_ctx.block_table_ptrs[0] == tables.block_tables[0].gpu.data_ptr()
                       else "gathered",
        "last_written": last_written, "non_last_written": non_last_written,
        "non_last_equals_last": same(last_states, non_last_states),
        "reordered_equals_last": same(last_states, reordered_states),
        "gathered_written": gathered_written, "gathered_equals_last": same(last_states, gathered_states),
    }))
''')


def test_mamba_spec_decode_copies_follow_each_request_on_a_non_last_rank(demo_snapshot):
    """Issue 39 item 3: a peer's PP3+MTP+prefix-caching series fixes "the mamba speculative-decoding
    context indexes the gathered block tables with a stale batch mapping, so recurrent state is
    written to the wrong rows" on non-last ranks. vLLM 0.34.0 (as 0.33.0) does not: the context's
    state copies read the per-request-slot block tables (MambaHybridModelState.initialize_kv_cache),
    and the kernels resolve each batch row through the mapping they are given to its request's slot;
    only the aligned state indices read the gathered tables, in the same step that gathered them.

    Run with vLLM's own GDN layers, KV cache planning and binding, BlockTables, model state and
    PPHandler bookkeeping: on a non-last rank at PP=2, step T's postprocess runs two steps late with
    step T's mapping, after step T+1 re-gathered the tables for another request, and writes exactly
    what the last rank's immediate postprocess writes; a reordered later batch changes nothing. The
    context the fix describes (copies through the gathered tables) writes the other request's block."""
    got = run_scenario(MAMBA_PP_SCENARIO, (str(demo_snapshot), free_port()), None, CPU_ENV)
    assert got["copies_read"] == "per-request-slot"
    # step T's postprocess: A's checkpoint block (column 0, block 1) and B's (column 1, block 6)
    assert got["last_written"] == got["non_last_written"] == [1, 6]
    assert got["non_last_equals_last"] and got["reordered_equals_last"]
    # the bug's shape, for contrast: A's copy lands in C's block 9 (step T+1's row 0), B's in none
    assert got["gathered_written"] == [9] and not got["gathered_equals_last"]
