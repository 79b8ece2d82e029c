"""What every program in benches/programs shares: offline transformers, no
cuDNN, seeds, the common arguments, a guard that no host decision reads a
device value, and the closing summary line.

The programs run on the project's simulated GPU (docs/simulated-gpu.md),
where kernels compute nothing: every value a kernel writes is garbage, but
allocations follow shapes exactly as on a GPU. So a program is a valid
benchmark only if its shapes and its control flow never depend on a value
computed on the device; `shapes_only` makes a violation an error instead of a
silently different allocation pattern.

Not a program itself (the leading underscore): `quilt-bench live` runs the
others, which import this file from their own folder.
"""

import argparse
import contextlib
import os
import random
import time
import warnings

# Before transformers is imported anywhere: configurations are built in code
# and weights are random, so nothing may be fetched.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# cuDNN is NVIDIA's own library and is not on the simulated GPU; convolutions
# take torch's native path instead, and SDPA never picks its cuDNN backend.
torch.backends.cudnn.enabled = False
torch.backends.cuda.enable_cudnn_sdp(False)

MIB = 1024 * 1024

# The name under which `unmasked_sdpa` registers transformers' SDPA attention.
UNMASKED_SDPA = "sdpa_unmasked"


def parser(doc, steps=None, seed=0):
    """An argument parser with the knobs every program has: --seed, --device
    (cuda by default; cpu to check shapes and speed without the simulated
    GPU) and, where `steps` is given, --steps."""
    first = doc.strip().splitlines()[0]
    p = argparse.ArgumentParser(description=first)
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help=f"steps to run (default {steps})")
    p.add_argument("--seed", type=int, default=seed, help=f"seed of weights, data and schedule (default {seed})")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    return p


def positive(p, args, *names):
    """Rejects, through the parser, any named argument that is not positive."""
    for name in names:
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")


def seeded(seed):
    """Seeds torch (every device) and returns the host random generator that
    draws the program's shape schedule."""
    torch.manual_seed(seed)
    return random.Random(seed)


def device_of(name):
    """The torch device, made current where it is a CUDA device."""
    dev = torch.device(name)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def autocast(dev, amp):
    """torch.autocast in bfloat16 where amp is "bf16", else a no-op. (fp16
    would need a GradScaler, whose step reads a device value, found_inf, to
    decide whether the optimizer steps.)"""
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp == "bf16")


def dtype_of(name):
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def host_tokens(gen, vocab, batch, length):
    """Token ids drawn on the host, as a data loader makes them."""
    return torch.randint(vocab, (batch, length), generator=gen)


def to_device(t, dev):
    """A host tensor on `dev` as a data loader with pin_memory=True hands it
    over: pinned, then copied without blocking the host."""
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def unmasked_sdpa():
    """Registers transformers' own SDPA attention under a name that its mask
    builder does not know, and returns that name.

    With it a decoder trained on unpadded batches attends with SDPA's
    `is_causal=True` and no mask tensor, as transformers' "sdpa" does on a GPU
    for such batches, but without the host reads transformers makes to find
    that out (whether the position ids pack several sequences, whether a
    padding mask has a zero): on the simulated GPU those reads see garbage
    and would pick the mask at random."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(UNMASKED_SDPA, sdpa_attention_forward)
    return UNMASKED_SDPA


@contextlib.contextmanager
def shapes_only(dev):
    """On a CUDA device, makes every synchronising read of device memory by
    the host an error (torch.cuda.set_sync_debug_mode("error")): `.item()`,
    `bool(t)`, `.tolist()`, `nonzero`, a blocking copy (so host tensors go
    to the device through `to_device`). Inside,
    no decision of the program or of a library can depend on a value a
    kernel computed. No-op elsewhere."""
    if dev.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        # "Synchronization debug mode is a prototype feature ..."
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def summary(name, dev, started, **fields):
    """Prints the program's one-line summary: its own fields, then the
    wall time since `started` and, on a CUDA device, torch's peak allocated
    and reserved bytes (whichever allocator answers torch's statistics)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        fields["peak_allocated_mib"] = f"{torch.cuda.max_memory_allocated(dev) / MIB:.1f}"
        fields["peak_reserved_mib"] = f"{torch.cuda.max_memory_reserved(dev) / MIB:.1f}"
    fields["seconds"] = f"{time.perf_counter() - started:.1f}"
    print(f"{name}: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def number(t):
    """A scalar tensor's value for the summary, read once at the end (garbage
    on the simulated GPU, where nothing depends on it)."""
    return f"{float(t):.4g}"
