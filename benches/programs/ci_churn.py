"""The smallest program of the live A/B (`quilt-bench live`): tensors of six
sizes allocated, combined elementwise and freed in a seeded order, about 300
live at a time, on one CUDA device. Shapes come from a seeded generator, never
from tensor values, so every run allocates the same sequence (kernels compute
nothing on the simulated GPU). Standard library and torch only.

    scripts/simulated-gpu.sh PYTHON benches/programs/ci_churn.py [--steps N] [--seed S]
"""

import argparse
import random

import torch

# Elements (float32) of the six sizes: 16 KiB to 24 MiB.
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 3 << 20, 6 << 20]
# How often each size is drawn: many small tensors, a few large ones.
WEIGHTS = [40, 25, 15, 10, 6, 4]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", type=int, default=300, help="tensors kept live")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    device = torch.device("cuda")
    live = []
    for step in range(args.steps):
        n = rng.choices(SIZES, WEIGHTS)[0]
        if live and rng.random() < 0.3:
            # An elementwise op of a live tensor: a new tensor of its size.
            i = rng.randrange(len(live))
            live.append(live[i] * 2 + 1)
        else:
            live.append(torch.empty(n, device=device).fill_(step))
        while len(live) > args.live:
            del live[rng.randrange(len(live))]
        if step % 500 == 499:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"ci_churn: {args.steps} steps, {len(live)} tensors live at the end")


if __name__ == "__main__":
    main()
