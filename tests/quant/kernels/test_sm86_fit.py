"""Every Triton variant flashnext launches while serving on an RTX 3090 (decode steps of 1..16
tokens and prefill, at Qwen3.8-Flash-Next's served shapes, with the launch rows a 3090 gets) fits
the 3090's 99 KiB of shared memory per block: each is compiled for sm_86 with Triton's bundled
ptxas, no GPU needed (``tests/support/sm86_launches.py``). The QSA row cache's kernels are
compiled by ``test_qsa_row_cache.py``."""

import json
import os
import subprocess
import sys

from support import SUPPORT_DIR

SM86_SHARED_BYTES = 99 * 1024  # the RTX 3090's opt-in shared memory per block
EXPECTED = {"_gemv_kernel", "_gate_up_kernel", "_down_combine_kernel", "_route_kernel", "_mma_kernel",
            "_up_gate_mix_kernel", "_gemm_kernel", "_bitplane_dequantize_kernel", "_int8_dequantize_kernel"}


def test_every_launch_a_3090_makes_fits_its_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # interpreted kernels do not compile
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT_DIR.parent), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, str(SUPPORT_DIR / "sm86_launches.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    variants = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {v["kernel"] for v in variants} == EXPECTED
    too_big = [v for v in variants if not 0 <= v["shared"] <= SM86_SHARED_BYTES]
    assert not too_big, too_big
