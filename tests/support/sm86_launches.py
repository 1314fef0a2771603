"""Every Triton kernel variant flashnext launches while serving Qwen3.8-Flash-Next on an RTX 3090,
compiled for sm_86 (Triton's bundled ptxas; no GPU): prints one JSON line per variant with the
shared memory it asks for. Run without TRITON_INTERPRET (an interpreted kernel cannot be compiled).

Nothing runs: ``JITFunction.run`` is replaced by a recorder, the kernels' entry points are called
at the model's served shapes for decode steps of 1..16 tokens and a 512-token prefill, with
meta tensors standing in for the device's (only their dtypes, shapes and alignment decide a variant),
and the SM count is the 3090's (82). The launch rows are those a 3090 gets (``configs`` family
``sm86``, which falls back to the ``default`` rows).
"""

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flashnext.quant.kernels import _common, configs

RTX_3090 = GPUTarget("cuda", 86, 32)
HIDDEN, SHARED, EXPERTS, TOP_K, HC, LOWRANK, VOCAB = 2560, 640, 512, 10, 4, 320, 248320
DECODE, PREFILL = (1, 2, 3, 4, 8, 16), 512

_common.sm_count = lambda device: 82
configs.device_family = lambda device: "sm86"
launched = []


def record(self, *args, grid, warmup, **kwargs):
    launched.append((self, args, kwargs))


JITFunction.run = record

from flashnext.quant.kernels import bitplane_gemv, decode_mma, dequantize, hc_mix, moe_route, prefill_gemm  # noqa: E402


def bf16(*shape):
    return torch.empty(shape, dtype=torch.bfloat16, device="meta")


def planes(n, k, group=64):
    return torch.empty(n, k * 3 // 4, dtype=torch.uint8, device="meta"), bf16(n, k // group)


def int8(n, k, group):
    return torch.empty(n, k // 4, dtype=torch.int32, device="meta"), bf16(n, k // group)


gate_up, down = planes(2 * SHARED, HIDDEN), planes(HIDDEN, SHARED)
lm_head = int8(VOCAB, HIDDEN, 128)
hc_down, hc_up = int8(LOWRANK + HC + 12, HC * HIDDEN, 64), int8(HC * HIDDEN, LOWRANK, 64)
router = bf16(EXPERTS + 1, HIDDEN)
for m in DECODE:
    x = bf16(m, HIDDEN)
    decode_mma.bitplane_matmul(x, *gate_up)
    decode_mma.bitplane_matmul(bf16(m, SHARED), *down)
    if m <= bitplane_gemv.GEMV_MAX_TOKENS:
        bitplane_gemv.bitplane_down_combine(bitplane_gemv.bitplane_gate_up_silu(x, *gate_up), *down, x, bf16(m, 1))
        moe_route.route(x, router, TOP_K, align_block=8)
    decode_mma.int8_mma(x, *lm_head)  # int8_matmul's pick for decode (meta tensors are no CUDA)
    hc_mix.hc_mix(bf16(m, HC * HIDDEN), hc_down, hc_up, LOWRANK, HC)
x = bf16(PREFILL, HIDDEN)
decode_mma.bitplane_matmul(x, *gate_up)
decode_mma.bitplane_matmul(bf16(PREFILL, SHARED), *down)
prefill_gemm.int8_gemm(x, *lm_head)  # int8_matmul's pick where the tiles fill the device
prefill_gemm.int8_gemm(bf16(PREFILL, LOWRANK), *hc_up)
# where they do not (the HC down/inject GEMM), and every prefill where a row says "dequantize"
dequantize.int8_dequantize(*hc_down, torch.bfloat16)
dequantize.bitplane_dequantize(*gate_up, torch.bfloat16)
dequantize.bitplane_dequantize(*down, torch.bfloat16)

backend = make_backend(RTX_3090)
seen = set()
for kernel, args, kwargs in launched:
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    key = (kernel.fn.__qualname__, repr(signature), repr(sorted(constexprs.items())), repr(attrs), repr(options))
    if key in seen:
        continue
    seen.add(key)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=RTX_3090,
                              options=options.__dict__)
    named = {kernel.params[path[0]].name: value for path, value in constexprs.items()}
    print(json.dumps({"kernel": kernel.fn.__qualname__, "shared": compiled.metadata.shared,
                      "constexprs": {k: v for k, v in named.items() if isinstance(v, (int, bool))}}), flush=True)
sys.exit(0 if seen else 1)
