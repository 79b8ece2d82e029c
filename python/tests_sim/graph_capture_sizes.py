"""A serving engine's CUDA graph capture, as vLLM and SGLang make it: 67
batch sizes (1, 2, 4, then 8 to 512 by 8), the largest first, each captured
into one shared private pool (``torch.cuda.graph(g, pool=shared_pool)``)
from a static input, of a small transformer-like block of Linear layers at
hidden width WIDTH (half precision).

    python graph_capture_sizes.py WIDTH keep|free

``keep``: every graph's output is kept (as an engine keeps its static
outputs); ``free``: each is freed after its capture. Under the allocator
``QUILT_SIM_ALLOCATOR`` names (``quilt``: ``quilt_torch.enable()``; anything
else: torch's own). Prints one line of JSON: the bytes reserved after the
captures (``reserved``), and what the captures added to what was reserved
before them (``captures``: the pool's memory).
"""

import json
import os
import sys

if os.environ.get("QUILT_SIM_ALLOCATOR") == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)

SIZES = sorted([1, 2, 4] + list(range(8, 513, 8)), reverse=True)


class Block(torch.nn.Module):
    """Attention's projections (without attention) and an MLP, with residuals."""

    def __init__(self, width):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + self.out(q * k + v)
        return h + self.down(torch.relu(self.up(h)))


def main():
    width, mode = int(sys.argv[1]), sys.argv[2]
    assert len(SIZES) == 67 and mode in ("keep", "free")
    model = torch.nn.Sequential(Block(width), Block(width)).cuda().half()
    static_in = torch.zeros(SIZES[0], width, device="cuda", dtype=torch.half)
    with torch.no_grad():
        for n in SIZES[:3]:  # warm-up outside any graph
            model(static_in[:n])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    pool = torch.cuda.graph_pool_handle()
    graphs, outputs = [], []
    with torch.no_grad():
        for n in SIZES:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = model(static_in[:n])
            graphs.append(g)
            if mode == "keep":
                outputs.append(out)
            del out
    torch.cuda.synchronize()
    for g in graphs[:2]:
        g.replay()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    print(
        json.dumps(
            {
                "reserved": reserved,
                "captures": reserved - before,
                "allocated": torch.cuda.memory_allocated(),
                "graphs": len(graphs),
            }
        )
    )


if __name__ == "__main__":
    main()
