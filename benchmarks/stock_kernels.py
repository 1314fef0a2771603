"""The kernels stock vLLM 0.33.0 would run where flashnext's patches run theirs: the baseline of
every kernel benchmark here (issue 28: "never slower than stock vLLM").

Without flashnext, an INT6 g64 or INT8 WNA16 layer goes through vLLM's mixed-precision chooser to
``HummingLinearKernel`` (``vllm/model_executor/kernels/linear/mixed_precision/humming.py``; Marlin,
Conch and Exllama take only 4 and 8 bits, and Marlin's INT8 needs vLLM's own CUDA build, which the
GPU machine does not have). :class:`StockLinear` builds a layer the way that kernel's
``process_weights_after_loading`` does (the humming weight schema from
``{"quant_method": "humming", "dtype": "int<bits>", "group_size": g}``, its symmetric-integer
conversion, ``prepare_and_transform_humming_tensors`` padded to N % 256 and K % 128, locks of
8 words per SM) and runs it the way ``apply_weights`` does (``humming_forward`` with vLLM's default
compute config). The vLLM glue is restated here rather than imported because the GPU machine has
no vLLM; the kernels and their tuning are humming's own.

The elementwise steps a patch fuses are vLLM's too: ``hc_silu`` / ``hc_gate_mix`` from vLLM's
model code (imported where vLLM or a carried copy of that module is importable), and the shared
expert's SiLU-and-mul and gated combine as vLLM's compiled graph runs them (``torch.compile`` of the
native formulas, one fused Triton kernel each; eager torch where compilation fails, and the
result says which).

Where a stock kernel cannot run (no humming, no GPU), its builder returns None and a reason, and
the benchmarks print that reason in its column instead of failing.
"""

from __future__ import annotations

import importlib
import json

import torch

# vLLM 0.33.0's defaults (vllm.envs: VLLM_BATCH_INVARIANT=0, VLLM_HUMMING_USE_F16_ACCUM=0) as
# get_humming_linear_compute_config serializes them.
COMPUTE_CONFIG = json.dumps({"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "dense"})
PAD_N, PAD_K = 256, 128  # prepare_humming_linear_layer_config's padding
MARLIN_MISSING = "Marlin (vLLM's INT8 uint8b128 path) needs vLLM's CUDA build, absent on this machine"


def humming_missing() -> str | None:
    """None where humming can run here, else why not (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module("humming.forward")
    except Exception as error:  # an import failure of any kind means the column is absent
        return f"humming-kernels not importable: {type(error).__name__}: {str(error)[:120]}"
    return None


class StockLinear:
    """``x @ W.T`` through Humming for signed ``codes [N, K]`` (int8 holding ``bits``-bit values)
    and bf16 group ``scales [N, K / group]``, prepared as vLLM's ``HummingLinearKernel`` prepares
    a compressed-tensors WNA16 layer."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bits: int):
        from humming import ops
        from humming.forward import humming_forward
        from humming.schema import BaseWeightSchema, HummingInputSchema
        from humming.transform import prepare_and_transform_humming_tensors

        n, k = codes.shape
        group = k // scales.shape[1]
        device = codes.device
        schema = BaseWeightSchema.from_config({"quant_method": "humming", "dtype": f"int{bits}",
                                               "group_size": group, "has_zero_point": False})
        # the checkpoint's offset-binary codes, as compressed-tensors stores them (q + 2^(bits-1))
        unsigned = (codes.to(torch.int32) + (1 << (bits - 1))).contiguous()
        tensors = {"weight": ops.pack_weight(unsigned, bits), "weight_scale": scales.to(torch.bfloat16).contiguous()}
        schema, tensors = schema.convert_humming(tensors=tensors, shape_n_stacks=[n], shape_k_stacks=[k],
                                                 param_dtype=torch.bfloat16, device=device)
        input_schema, _ = HummingInputSchema().convert_humming(tensors=tensors, shape_n_stacks=[n], shape_k_stacks=[k],
                                                               param_dtype=torch.bfloat16)
        self.config, self.tensors = prepare_and_transform_humming_tensors(
            tensors=tensors, shape_n=n, shape_k=k, weight_schema=schema, input_schema=input_schema,
            pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K, has_bias=False, torch_dtype=torch.bfloat16,
            device=device)
        self.hadamard = schema.hadamard_block_size
        self.locks = torch.zeros(torch.cuda.get_device_properties(device).multi_processor_count * 8,
                                 dtype=torch.int32, device=device)
        self.n = n
        self._forward = humming_forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = self.tensors
        y = self._forward(self.config, inputs=x.reshape(-1, x.shape[-1]), weight=t["weight"],
                          weight_scale=t.get("weight_scale"), zero_point=t.get("zero_point"), bias=None,
                          weight_scale_2=t.get("weight_scale_2"), hadamard_block_size=self.hadamard,
                          locks=self.locks, compute_config=COMPUTE_CONFIG)
        return y[..., :self.n] if y.shape[-1] != self.n else y


def stock_linear(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[StockLinear | None, str | None]:
    """(the stock layer, None), or (None, why it cannot run here)."""
    missing = humming_missing()
    if missing:
        return None, missing
    try:
        return StockLinear(codes, scales, bits), None
    except Exception as error:  # humming refusing a shape is a result to report, not a crash
        return None, f"humming refused [{codes.shape[0]}, {codes.shape[1]}] int{bits}: {type(error).__name__}: " \
                     f"{str(error)[:160]}"


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _gated_combine(shared: torch.Tensor, gate_logit: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(gate_logit) * shared + routed


def compiled(fn, *example):
    """(``fn`` compiled by Inductor, "inductor"), or (``fn``, "eager") where compiling it for
    ``example`` fails (Inductor is lazy: the first call is where it fails)."""
    try:
        candidate = torch.compile(fn, dynamic=False, fullgraph=True)
        candidate(*example)
        return candidate, "inductor"
    except Exception:  # noqa: BLE001 - no compiler here: eager is the upper bound, and is labelled so
        return fn, "eager"


def elementwise_steps(hidden: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor):
    """vLLM's shared-expert SiLU-and-mul (``SiluAndMul.forward_native``) and the gated combine of
    ``Qwen2MoeMLP`` and its runner, each compiled for these inputs where Inductor runs; and the mode."""
    silu, mode = compiled(_silu_and_mul, hidden)
    combine, combine_mode = compiled(_gated_combine, shared, gate_logit, shared)
    return silu, combine, mode if mode == combine_mode else f"{mode}/{combine_mode}"


def hc_elementwise():
    """vLLM's own ``hc_silu`` and ``hc_gate_mix`` (Triton), or (None, None, why not)."""
    try:
        from vllm.models.qwen4_exp.nvidia.ops.hc import hc_gate_mix, hc_silu
    except Exception as error:  # noqa: BLE001
        return None, None, f"vLLM's hc ops not importable: {type(error).__name__}: {str(error)[:120]}"
    return hc_silu, hc_gate_mix, None
