"""Patch vit-stream on a GPU: a vision tower of the release's shape (27 blocks, hidden 1152, MLP
4304, 16 heads: 29 MiB of bf16 weights a block) run resident and streamed through two slots by
``flashnext.serving.hooks.vit_stream.BlockStream``, side by side in one process, for a few image
sizes. The blocks are plain torch (vLLM is not on the GPU machine); the stream is the product's.

    python benchmarks/vit_stream.py [--json] [--tokens 1024 4096 8192]

Reports per image size: resident and streamed forward (ms, median of CUDA-event timings), the
streamed overhead per block, one block's host-to-device copy alone, and whether the streamed output
equals the resident one bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from flashnext.serving.runtime.block_stream import BlockStream

HIDDEN, MLP, HEADS, DEPTH = 1152, 4304, 16, 27


class VisionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, MLP)
        self.fc2 = torch.nn.Linear(MLP, HIDDEN)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], 3, HEADS, -1).permute(1, 2, 0, 3).contiguous().unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)  # [heads, tokens, 72]: one image, full attention
        x = x + self.proj(attn.transpose(0, 1).reshape(x.shape))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def tower(seed: int) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(VisionBlock() for _ in range(DEPTH)).to("cuda", torch.bfloat16)


def run(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def timed(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192],
                        help="patches per image after the patch embedding (2 MP at 16 px: about 8192)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    resident, streamed = tower(0), tower(0)
    stream = BlockStream(streamed)
    host = torch.empty(stream.block_bytes, dtype=torch.uint8, pin_memory=True)
    slot = torch.empty(stream.block_bytes, dtype=torch.uint8, device="cuda")
    copy_ms = timed(lambda: slot.copy_(host, non_blocking=True))
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            r_ms = timed(lambda: run(resident, x))
            s_ms = timed(lambda: run(streamed, x))
            same = torch.equal(run(resident, x), run(streamed, x))
            rows.append({"tokens": tokens, "resident_ms": round(r_ms, 3), "streamed_ms": round(s_ms, 3),
                         "overhead_per_block_ms": round((s_ms - r_ms) / DEPTH, 4),
                         "resident_per_block_ms": round(r_ms / DEPTH, 4), "bit_identical": same})
    out = {"device": torch.cuda.get_device_name(), "blocks": DEPTH, "block_mib": round(stream.block_bytes / 2**20, 2),
           "resident_mib": round(DEPTH * stream.block_bytes / 2**20, 1), "slots_mib": round(stream.device_bytes / 2**20, 1),
           "h2d_copy_per_block_ms": round(copy_ms, 3), "results": rows}
    print(json.dumps(out, indent=1 if args.json else None))


if __name__ == "__main__":
    main()
