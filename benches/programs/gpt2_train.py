"""GPT-2 language-model training with a sequence length that changes every step.

Models: pre-training a GPT-2 (transformers' GPT2LMHeadModel, random weights,
by default 6 layers, 768 wide, 12 heads, GPT-2's vocabulary of 50,257, so
about 81 M parameters) with AdamW (weight decay 0.1), gradient clipping at
1.0 and bfloat16 autocast, on batches of token ids drawn on the host and
copied to the device, as a data loader gives them.

Shape schedule: --steps steps of --batch sequences each; step i's length is
drawn (seeded) from [--min-len, --max-len] in multiples of 8, never the
length of the step before, so every step's activations, attention and
logits (batch x length x 50,257, the largest tensors) have a new size, and
the allocator's cached blocks rarely fit exactly. Sequences are unpadded:
attention is SDPA's causal mode with no mask tensor (see
_common.unmasked_sdpa), and no host decision reads a device value
(_common.shapes_only).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def length_schedule(rng, steps, low, high):
    """One length per step, multiples of 8 in [low, high], each different
    from the one before where the range allows."""
    choices = list(range(low, high + 1, 8))
    lengths = []
    for _ in range(steps):
        options = [n for n in choices if not lengths or n != lengths[-1]] or choices
        lengths.append(rng.choice(options))
    return lengths


def gpt2_model(vocab, embd, layers, heads, positions, dev):
    """A GPT-2 language model with random weights on `dev`, attending with
    causal SDPA and no mask tensor."""
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=positions,
        n_embd=embd,
        n_layer=layers,
        n_head=heads,
        use_cache=False,
        # GPT-2's own <|endoftext|> where the vocabulary has it.
        bos_token_id=50256 if vocab > 50256 else None,
        eos_token_id=50256 if vocab > 50256 else None,
    )
    config._attn_implementation = _common.unmasked_sdpa()
    model = GPT2LMHeadModel(config).to(dev)
    # transformers finds the loss by the class name, which does not say it.
    model.loss_type = "ForCausalLM"
    return model


def main():
    p = _common.parser(__doc__, steps=10)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--min-len", type=int, default=64, help="shortest sequence (default 64)")
    p.add_argument("--max-len", type=int, default=512, help="longest sequence (default 512)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--embd", type=int, default=768, help="model width (default 768)")
    p.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary (default 50257)")
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast (default bf16)")
    args = p.parse_args()
    _common.positive(p, args, "steps", "batch", "min_len", "max_len", "layers", "embd", "heads", "vocab")
    if args.min_len > args.max_len:
        p.error("--min-len must not exceed --max-len")
    if args.embd % args.heads:
        p.error("--embd must be a multiple of --heads")

    started = time.perf_counter()
    rng = _common.seeded(args.seed)
    lengths = length_schedule(rng, args.steps, args.min_len, args.max_len)
    dev = _common.device_of(args.device)
    data = torch.Generator().manual_seed(args.seed)

    model = gpt2_model(args.vocab, args.embd, args.layers, args.heads, max(1024, args.max_len), dev)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    total = torch.zeros((), device=dev)
    with _common.shapes_only(dev):
        for length in lengths:
            ids = _common.to_device(_common.host_tokens(data, args.vocab, args.batch, length), dev)
            with _common.autocast(dev, args.amp):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()

    params = sum(t.numel() for t in model.parameters())
    _common.summary(
        "gpt2_train",
        dev,
        started,
        device=dev,
        params_m=f"{params / 1e6:.1f}",
        steps=args.steps,
        batch=args.batch,
        lengths=f"{min(lengths)}..{max(lengths)}",
        mean_loss=_common.number(total / args.steps),
    )


if __name__ == "__main__":
    main()
