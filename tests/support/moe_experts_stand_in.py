"""The routed experts' kernel stood in for by its arithmetic, an expert at a time over the tokens
routed to it (support/vllm_demo.py's ``stand_in_experts_kernel`` goes a token at a time, which the
engine-ledger scenario's 512-token steps make slow under its allocation recorder). Same boundary:
the quant method's ``apply(layer, x, topk_weights, topk_ids)``; this vLLM build has no CPU MoE
kernel. Living in support/, what it allocates is a stand-in's, not flashnext's
(support/allocations.py's ``stand_ins``)."""

import torch


def stand_in_experts_kernel(experts) -> None:
    def apply(layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        out = torch.zeros(x.shape, dtype=torch.float32)
        xf = x.float()
        for e in topk_ids.unique().tolist():
            tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
            gate, up = (xf[tokens] @ layer.w13_weight[e].float().T).chunk(2, dim=-1)
            routed = (torch.nn.functional.silu(gate) * up) @ layer.w2_weight[e].float().T
            out.index_add_(0, tokens, topk_weights[tokens, slots].float()[:, None] * routed)
        return out.to(x.dtype)

    experts.quant_method.apply = apply
