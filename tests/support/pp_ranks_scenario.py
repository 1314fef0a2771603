"""One rank of a pipeline of WORLD gloo ranks on the CPU building vLLM 0.34.0's own ``qwen4_exp``
model for the demo checkpoint with MTP speculative decoding, as ``vllm serve --speculative-config
'{"method": "mtp"}'`` configures it, and loading the release's INT8 ``embed_tokens`` and ``lm_head``
(patches mtp-01, mtp-02, int8-modules; mem-01's placement is vLLM 0.34.0's own):

* the target (``Qwen4ExpForConditionalGeneration``, vLLM's ``initialize_model``) takes the
  checkpoint's embed_tokens and lm_head tensors through its own ``load_weights``;
* on the last rank (where Model Runner V2 builds the drafter) the draft is made by vLLM's own
  ``load_eagle_model``: ``get_model`` (the default loader over the snapshot's safetensors files,
  ``Qwen4ExpMTP.load_weights``, every module's post-load step), then its sharing of the target's
  embedding and LM head. A spy on ``Qwen4ExpMTP.load_weights`` notes what the draft had built and
  loaded before the sharing;
* the draft's forward is entered with token ids and the target's multi-stream hidden states; a
  hook at ``pre_fc_norm_embedding`` records the embedded rows the forward uses.

``python pp_ranks_scenario.py RANK PORT SNAPSHOT WORLD`` prints the rank's result as JSON; values
are compared with the checkpoint's words dequantized here by compressed-tensors' own unpacker.

Stood in for, because it cannot exist on the CPU: the routed experts' post-load kernel set-up (this vLLM build has no CPU MoE kernels; the experts are
never run here). The quantization config keeps its INT8 groups (the rest have no CPU kernel);
the PLE and indexer projections, which vLLM quantizes itself through Marlin, are dropped from them.
"""
import json
import os
import sys

import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open
from vllm.distributed import get_pp_group

from support.vllm_demo import demo_vllm

rank, port, snapshot, world = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
TEXT = "model.language_model."


def int8_embedding_and_mixers(config):
    qc = getattr(config, "quantization_config", None)
    if qc is not None:
        keep = {k: g for k, g in qc["config_groups"].items() if g["weights"]["num_bits"] == 8}
        for group in keep.values():
            if "lm_head" in group["targets"]:
                group["targets"] = ["lm_head", "re:.*embed_tokens$"]
        qc["config_groups"] = keep
    return config


index = json.load(open(os.path.join(snapshot, "model.safetensors.index.json")))["weight_map"]


def read(names):
    out = {}
    for name in names:
        with safe_open(os.path.join(snapshot, index[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def dequantized(prefix: str) -> torch.Tensor:
    """The checkpoint's INT8 rows at ``prefix`` (weight_packed, weight_scale, weight_shape) as bf16."""
    t = read([prefix + s for s in ("weight_packed", "weight_scale", "weight_shape")])
    shape = torch.Size(t[prefix + "weight_shape"].tolist())
    codes = unpack_from_int32(t[prefix + "weight_packed"], 8, shape).float()
    scale = t[prefix + "weight_scale"].float()
    groups = codes.view(shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)
    return groups.view(shape).to(torch.bfloat16)


def method(module) -> str:
    return type(getattr(module, "quant_method", None)).__name__ if hasattr(module, "quant_method") else "-"


out = {"rank": rank}
with demo_vllm(snapshot, port, int8_embedding_and_mixers, mtp=True, rank=rank, world=world) as (config, _):
    from vllm.model_executor.model_loader.utils import initialize_model

    target = initialize_model(vllm_config=config)
    text = target.language_model
    out["embed_tokens"] = type(text.model.embed_tokens).__name__
    out["lm_head"] = type(text.lm_head).__name__
    out["methods"] = [method(text.model.embed_tokens), method(text.lm_head)]
    heads = read([n for n in index if n.startswith((TEXT + "embed_tokens.", "lm_head."))])
    try:
        loaded = target.load_weights(iter(heads.items()))
    except ValueError as error:  # stock: the INT8 tensors meet bf16 layers
        print(json.dumps({**out, "target_error": str(error).split("\n")[0][:160]}))
        sys.exit(0)
    out["loaded"] = sorted(n for n in loaded if "embed_tokens" in n or "lm_head" in n)
    out["head_bytes"] = sum(p.numel() * p.element_size() for m in (text.model.embed_tokens, text.lm_head)
                            for p in m.parameters())

    if get_pp_group().is_last_rank:
        import vllm.model_executor.layers.utils as layer_utils
        from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP
        from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        # stand-ins: the CPU backend's GEMM and MoE weight pre-packing need vLLM's compiled CPU ops,
        # which this build lacks (a CUDA run has neither step)
        layer_utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: setattr(
            layer, "cpu_linear", torch.nn.functional.linear)
        CPUUnquantizedExperts.process_weights_after_loading = lambda self, layer: None
        built = {}
        vllm_load_weights = Qwen4ExpMTP.load_weights

        def spy(self, weights):
            try:
                result = vllm_load_weights(self, weights)
            except Exception as error:
                built["refused"] = str(error).split("\n")[0][:160]
                raise
            built["embed_tokens"] = type(self.model.embed_tokens).__name__
            built["lm_head"] = type(self.lm_head).__name__
            built["methods"] = [method(self.model.embed_tokens), method(self.lm_head)]
            built["loaded"] = sorted(n for n in result if "embed_tokens" in n or "lm_head" in n)
            built["embedding_on_host"] = sorted(getattr(self.model.embed_tokens, "host_tensors", {}))
            return result

        Qwen4ExpMTP.load_weights = spy
        from flashnext.serving.hooks import mtp as mtp_hooks

        try:
            draft = load_eagle_model(target, config)
        except Exception as error:
            draft = None
            out["draft_error"] = f"{type(error).__name__}: {built.get('refused', str(error)[:160])}"
        out["draft_built"] = built
        if draft is not None:
            embed = draft.model.embed_tokens
            out["draft_embed_shared"] = embed is text.model.embed_tokens
            out["draft_lm_head_shared"] = draft.lm_head is text.lm_head
            out["draft_embed_methods"] = [method(embed), method(draft.lm_head)]
            out["draft_embed_pinned_bytes"] = sum(p.numel() * p.element_size() for p in
                                                  mtp_hooks.host_resident_parameters(embed).values())
            c = config.model_config.hf_text_config
            out["plan_pinned_bytes"] = mtp_hooks.draft_embedding_pinned_bytes(c.vocab_size, c.hidden_size, 128)
            want = dequantized(TEXT + "embed_tokens.")
            ids = torch.tensor([0, 7, 4095, 12, 7, 1000])
            got = draft.embed_input_ids(ids)
            out["draft_embedding_exact"] = bool(torch.equal(got, want[ids]))
            used = []
            hook = draft.model.pre_fc_norm_embedding.register_forward_pre_hook(lambda m, a: used.append(a[0]))
            hidden = torch.randn(ids.numel(), c.hc_count * c.hidden_size, generator=torch.Generator().manual_seed(0))
            from support.vllm_demo import stand_in_experts_kernel
            from vllm.forward_context import set_forward_context

            stand_in_experts_kernel(draft.model.layers[0].mlp.experts.routed_experts, [])
            try:
                with torch.no_grad(), set_forward_context(None, config, num_tokens=ids.numel()):
                    single, multi = draft(ids, torch.arange(ids.numel()), hidden.to(torch.bfloat16))
                out["draft_forward"] = "ran"
                out["draft_output_finite"] = bool(torch.isfinite(single).all() and torch.isfinite(multi).all())
            except Exception as error:  # past the embedding the layer needs attention metadata
                import traceback

                frame = traceback.extract_tb(error.__traceback__)[-1]
                out["draft_forward"] = f"{type(error).__name__} in {frame.name}"
            hook.remove()
            out["draft_forward_embedded"] = bool(used) and bool(torch.equal(used[0], want[ids]))
print(json.dumps(out))
