"""Each patch's probe: what proves, in the patched tree, that the patch is there.

They are functions rather than text so that they are linted and imported like the rest of the code.
`flashnext patches check` and the selftest call them all in one fresh interpreter that imports the
patched tree (``patch_series.probe_tree``), so each imports vLLM inside its body: importing this
module must not import vLLM.
"""

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path


def ple_mmap() -> None:
    import vllm.models.qwen4_exp.nvidia.ngram_embedding as n
    assert 'ple_file.embedding_class()' in inspect.getsource(n.Qwen4ExpNGramEmbedding.__init__)
    import vllm.models.qwen4_exp.nvidia.model_state as m
    assert 'self.ple_file.stage(ple_ids)' in inspect.getsource(m.Qwen4ExpModelState.prepare_inputs)
    from flashnext.serving.hooks.ple_file import embedding_class
    assert embedding_class().__mro__[1].__name__ == 'Qwen4ExpPLEEmbedding'


def decode_06() -> None:
    import vllm.models.qwen4_exp.nvidia.model_state as m
    assert 'self.ple_file.advise(ple_ids)' in inspect.getsource(m.Qwen4ExpModelState.prepare_inputs)


def ttft_01() -> None:
    import vllm.models.qwen4_exp.nvidia.model_state as m
    assert 'self.ple_file.admitted(' in inspect.getsource(m.Qwen4ExpModelState.add_request)
    assert 'self.ple_file.finished(req_id)' in inspect.getsource(m.Qwen4ExpModelState.remove_request)


def host_pool() -> None:
    import vllm.models.qwen4_exp.common.ngram_embedding as n
    assert 'pinned_empty((num_embeddings, embedding_dim), dtype)' in inspect.getsource(n.Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight)


def mtp_01() -> None:
    import vllm.models.qwen4_exp.nvidia.mtp as m
    assert 'draft_embedding_method(' in inspect.getsource(m.Qwen4ExpMultiTokenPredictor.__init__)
    assert 'draft_embedding_method(' in inspect.getsource(m.Qwen4ExpMTP.__init__)


def mtp_02() -> None:
    import vllm.models.qwen4_exp.nvidia.mtp as m
    assert 'draft_lm_head(' in inspect.getsource(m.Qwen4ExpMTP.__init__)
    assert 'draft_embedding(' in inspect.getsource(m.Qwen4ExpMultiTokenPredictor.__init__)
    assert 'finish_draft_embedding(self.model.embed_tokens)' in inspect.getsource(m.Qwen4ExpMTP.load_weights)


def decode_03() -> None:
    import vllm.v1.worker.gpu_worker as w
    src = inspect.getsource(w.Worker.execute_model)
    assert 'deferred_intermediate_tensors(' in src and 'intermediate_tensors.wait_for_comm()' in src


def qsa_indexer_quant() -> None:
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # qsa imports the model module back
    import vllm.models.qwen4_exp.nvidia.qsa as q
    assert 'qsa_indexer_quant.fuse_indexer_projection(' in inspect.getsource(q.Qwen4ExpQSAAttention.__init__)


def qsa_offload() -> None:
    importlib.import_module("vllm.models.qwen4_exp.nvidia.model")  # qsa imports the model module back
    import vllm.models.qwen4_exp.nvidia.qsa as q
    src = inspect.getsource(q.Qwen4ExpQSAAttention)
    assert 'qsa_offload.attach(self, vllm_config)' in src and 'self.qsa_offload.main_metadata(metadata)' in src
    assert 'impl = self.impl if self.qsa_offload is None else self.qsa_offload' in src
    import vllm.platforms.interface as i
    assert 'qsa_offload.align_block_size(vllm_config)' in inspect.getsource(i.Platform._align_hybrid_block_size)
    import vllm.models.qwen4_exp.common.qsa_indexer as c
    assert 'self.qsa_offload.bind(self.kv_cache)' in inspect.getsource(c._QSAIndexerCache.bind_kv_cache)


def int8_modules() -> None:
    import vllm.models.qwen4_exp.nvidia.model as m
    assert 'int8_modules.embedding_method(' in inspect.getsource(m.Qwen4ExpModel.__init__)
    assert 'int8_modules.embedding_method(' in inspect.getsource(m.Qwen4ExpForCausalLM.__init__)
    import vllm.models.qwen4_exp.nvidia.hyperconnection as h
    assert inspect.getsource(h.GatedResidual.__init__).count('quant_config=hc_quant_config(') == 3


def decode_04() -> None:
    import vllm.models.qwen4_exp.nvidia.hyperconnection as h
    assert 'hc_decode.mix(self, xn)' in inspect.getsource(h.GatedResidual.mix)
    assert 'hc_decode.mix(self, xn)' in inspect.getsource(h.GatedResidual.combine_and_mix)


def int6_bitplane() -> None:
    # vLLM's own plugin loading (as its engine and workers do) registers flashnext's config
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    config = get_quantization_config('compressed-tensors')
    assert config.__name__ == 'FlashnextCompressedTensorsConfig', f'compressed-tensors resolves to {config.__qualname__}'


def decode_05() -> None:
    import vllm.models.qwen4_exp.nvidia.model as m
    assert 'moe_decode.forward(self, hidden_states)' in inspect.getsource(m.Qwen4ExpSparseMoeBlock.forward)
    import vllm.model_executor.layers.fused_moe.experts.marlin_moe as mm
    assert 'moe_decode.alignment_for(topk_ids, block_size_m' in inspect.getsource(mm.fused_marlin_moe)


def vit_stream() -> None:
    import vllm.models.qwen4_exp.nvidia.model as m
    assert 'vit_stream.install(self)' in inspect.getsource(m.Qwen4ExpForConditionalGeneration.process_weights_after_loading)
    assert 'vit_stream.build_context()' in inspect.getsource(m.Qwen4ExpForConditionalGeneration.__init__)


def step_time() -> None:
    import vllm.v1.worker.gpu.cudagraph_utils as c
    src = inspect.getsource(c.CudaGraphManager.run_fullgraph)
    assert 'replay(self, desc)' in src and 'self.graphs[desc].replay()' not in src
    # read, not imported: importing it (and its packages) costs the check FastAPI and the instrumentator
    import vllm
    src = (Path(vllm.__file__).parent / 'entrypoints/serve/instrumentator/metrics.py').read_text()
    [attach] = [f for f in ast.parse(src).body if isinstance(f, ast.FunctionDef) and f.name == 'attach_router']
    assert 'register_collector(registry)' in ast.get_source_segment(src, attach)


# What finds upstream's own fix of an absorbed patch (series.ABSORBED): passes on stock 0.34.0.

def upstream_mtp_03() -> None:
    import vllm.v1.worker.gpu.spec_decode.utils as u
    assert '_draft_tokens_by_req' in inspect.getsource(u.DraftTokensHandler.__init__)
    assert callable(getattr(u.DraftTokensHandler, 'begin_step', None))
    assert callable(getattr(u.DraftTokensHandler, 'discard', None))


def upstream_pp_ple() -> None:
    import vllm.model_executor.models.config as c
    assert 'requires pipeline_parallel_size=1' not in inspect.getsource(c.Qwen4ExpForConditionalGenerationConfig)
    import vllm.models.qwen4_exp.nvidia.model_state as m
    assert 'pipeline_parallel_size > 1' not in inspect.getsource(m.Qwen4ExpModelState.__init__)
    import vllm.v1.core.kv_cache_planning as p
    # each group's own layer names, not the whole-model spec's (0.33.0 iterated kv_cache_specs)
    src = inspect.getsource(p.get_kv_cache_config_from_groups)
    assert 'in group.layer_names' in src and 'group_spec.kv_cache_specs.items()' not in src


def upstream_mem_01() -> None:
    import vllm.models.qwen4_exp.nvidia.model as m
    assert 'PPMissingLayer()' in inspect.getsource(m.Qwen4ExpModel.__init__)
    assert 'PPMissingLayer()' in inspect.getsource(m.Qwen4ExpForCausalLM.__init__)


def upstream_mtp_01_branch() -> None:
    import vllm.models.qwen4_exp.nvidia.mtp as m
    src = inspect.getsource(m.Qwen4ExpMultiTokenPredictor.forward)
    assert 'get_pp_group().is_first_rank' not in src and 'if intermediate_tensors is None:' in src
