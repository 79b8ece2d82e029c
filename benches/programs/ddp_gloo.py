"""Data-parallel training of a GPT-2 in two processes over gloo, with CUDA tensors.

Models: DistributedDataParallel as `torchrun --nproc-per-node 2` runs it on a
machine without NCCL: two processes spawned by torch.multiprocessing, rank r
on cuda:r, a gloo process group over loopback TCP (init_method
tcp://127.0.0.1:PORT, a free port), a GPT-2 (transformers' GPT2LMHeadModel,
random weights, by default 4 layers, 512 wide, 8 heads, vocabulary 16,384:
about 21 M parameters) wrapped in DDP (parameters broadcast from rank 0 at
wrap, gradients all-reduced in buckets during backward; gloo copies CUDA
tensors through pinned host memory), AdamW, then a barrier and
destroy_process_group, and a clean exit of both processes.

Shape schedule: --steps steps of --batch sequences per rank; step i's length
is drawn (seeded, the same on both ranks) from [--min-len, --max-len] in
multiples of 8, a new length every step; each rank draws its own tokens.
Unpadded, causal SDPA without a mask tensor (_common.unmasked_sdpa).

Unlike the other programs this one does not forbid synchronising reads
(_common.shapes_only): gloo's collectives on CUDA tensors wait for their
copies to the host, which torch's sync debug mode counts. No host decision
depends on a device value all the same.

The parent prints one line with each rank's figures (each rank's peak
allocated and reserved on its own device, from torch's statistics in that
process); the parent itself never touches CUDA.
"""

import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import gpt2_train  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

WORLD = 2


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(name, rank):
    """cuda:RANK where the program runs on CUDA, else the named device."""
    return torch.device("cuda", rank) if torch.device(name).type == "cuda" else torch.device(name)


def worker(rank, args, port, results):
    dev = _common.device_of(str(rank_device(args.device, rank)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    rng = _common.seeded(args.seed)
    lengths = gpt2_train.length_schedule(rng, args.steps, args.min_len, args.max_len)
    data = torch.Generator().manual_seed(args.seed * WORLD + rank)

    model = gpt2_train.gpt2_model(args.vocab, args.embd, args.layers, args.heads, max(1024, args.max_len), dev)
    model.train()
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-4, weight_decay=0.1)

    total = torch.zeros((), device=dev)
    for length in lengths:
        ids = _common.to_device(_common.host_tokens(data, args.vocab, args.batch, length), dev)
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total += loss.detach()

    dist.barrier()
    figures = {"mean_loss": _common.number(total / args.steps)}
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        figures["peak_allocated_mib"] = f"{torch.cuda.max_memory_allocated(dev) / _common.MIB:.1f}"
        figures["peak_reserved_mib"] = f"{torch.cuda.max_memory_reserved(dev) / _common.MIB:.1f}"
    dist.destroy_process_group()
    results.put((rank, figures, sum(t.numel() for t in model.parameters()), lengths))


def main():
    p = _common.parser(__doc__, steps=6)
    p.add_argument("--batch", type=int, default=4, help="sequences per step and rank (default 4)")
    p.add_argument("--min-len", type=int, default=64, help="shortest sequence (default 64)")
    p.add_argument("--max-len", type=int, default=256, help="longest sequence (default 256)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--embd", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=16384, help="vocabulary (default 16384)")
    args = p.parse_args()
    _common.positive(p, args, "steps", "batch", "min_len", "max_len", "layers", "embd", "heads", "vocab")
    if args.min_len > args.max_len:
        p.error("--min-len must not exceed --max-len")
    if args.embd % args.heads:
        p.error("--embd must be a multiple of --heads")
    if torch.device(args.device).type == "cuda" and torch.cuda.device_count() < WORLD:
        p.error(f"needs {WORLD} CUDA devices, found {torch.cuda.device_count()}")

    started = time.perf_counter()
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, free_port(), results), nprocs=WORLD, join=True)
    ranks = sorted(results.get() for _ in range(WORLD))

    fields = {"device": args.device, "ranks": WORLD}
    _, _, params, lengths = ranks[0]
    fields["params_m"] = f"{params / 1e6:.1f}"
    fields["steps"] = args.steps
    fields["lengths"] = f"{min(lengths)}..{max(lengths)}"
    for rank, figures, _, _ in ranks:
        for key, value in figures.items():
            fields[f"rank{rank}_{key}"] = value
    fields["seconds"] = f"{time.perf_counter() - started:.1f}"
    print("ddp_gloo: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


if __name__ == "__main__":
    main()
