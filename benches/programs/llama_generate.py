"""Greedy generation with a Llama-style decoder and a growing KV cache, at varying batch sizes and prompt lengths.

Models: serving requests one batch at a time with a Llama decoder
(transformers' LlamaForCausalLM, random weights in bfloat16, by default 8
layers, 1024 wide, 16 query heads over 4 key/value heads, MLP 2816,
vocabulary 32,000: about 150 M parameters), decoding as `generate()` does
with a DynamicCache: one prefill of the prompt, then one token at a time,
the cache of every layer growing by one position per step
(torch.cat into a new tensor), logits of the last position only
(logits_to_keep=1), the next token the argmax of the logits, appended to
the sequence.

Shape schedule: --rounds batches; round i's batch size is drawn (seeded)
from --batches and its prompt length from [--min-prompt, --max-prompt];
each round generates exactly --new-tokens tokens (no stop at an end-of-
sequence token: on the simulated GPU the argmax is garbage, and nothing on
the host reads it). Prompts in a batch have the same length, so there is no
padding and no attention mask (transformers would read a padding mask's
values on the device to decide whether to build one).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402


def llama_config(hidden, layers, heads, kv_heads, mlp, vocab, positions):
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        attn_implementation="sdpa",
    )


def load(config, dev, dtype):
    """The model with random weights made directly in `dtype` on the device,
    layer by layer in the order a checkpoint loader places them."""
    with torch.device(dev):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def generate(model, prompt, new_tokens):
    """Greedy decoding of `new_tokens` tokens after `prompt` (batch x
    length, on the model's device); returns the whole sequences."""
    cache = DynamicCache(config=model.config)
    sequences = prompt
    step_input = prompt
    for _ in range(new_tokens):
        logits = model(input_ids=step_input, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        step_input = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        sequences = torch.cat([sequences, step_input], dim=-1)
    return sequences


def requests(rng, rounds, batches, low, high):
    """(batch size, prompt length) of each round."""
    return [(rng.choice(batches), rng.randint(low, high)) for _ in range(rounds)]


def serve(model, schedule, new_tokens, vocab, gen, dev):
    """Generates every round of the schedule; returns the tokens generated."""
    made = 0
    for batch, length in schedule:
        prompt = _common.to_device(_common.host_tokens(gen, vocab, batch, length), dev)
        sequences = generate(model, prompt, new_tokens)
        made += sequences.shape[0] * (sequences.shape[1] - length)
        del sequences
    return made


def add_model_arguments(p, hidden, layers, heads, kv_heads, mlp):
    p.add_argument("--hidden", type=int, default=hidden, help=f"model width (default {hidden})")
    p.add_argument("--layers", type=int, default=layers, help=f"decoder layers (default {layers})")
    p.add_argument("--heads", type=int, default=heads, help=f"query heads (default {heads})")
    p.add_argument("--kv-heads", type=int, default=kv_heads, help=f"key/value heads (default {kv_heads})")
    p.add_argument("--mlp", type=int, default=mlp, help=f"MLP width (default {mlp})")


def add_serving_arguments(p, rounds):
    p.add_argument("--rounds", type=int, default=rounds, help=f"batches served (default {rounds})")
    p.add_argument("--batches", default="1,2,4,8,16,32", help="batch sizes to draw from (default 1,2,4,8,16,32)")
    p.add_argument("--min-prompt", type=int, default=16, help="shortest prompt (default 16)")
    p.add_argument("--max-prompt", type=int, default=2048, help="longest prompt (default 2048)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per round (default 64)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="weights (default bfloat16)")


def batch_sizes(p, text):
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {text!r}")
    if not sizes or min(sizes) <= 0:
        p.error(f"--batches must list positive sizes, got {text!r}")
    return sizes


def check_serving(p, args):
    _common.positive(p, args, "rounds", "min_prompt", "max_prompt", "new_tokens", "vocab")
    if args.min_prompt > args.max_prompt:
        p.error("--min-prompt must not exceed --max-prompt")
    return batch_sizes(p, args.batches)


def check_model(p, args):
    _common.positive(p, args, "hidden", "layers", "heads", "kv_heads", "mlp")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")


def main():
    p = _common.parser(__doc__)
    add_model_arguments(p, hidden=1024, layers=8, heads=16, kv_heads=4, mlp=2816)
    add_serving_arguments(p, rounds=16)
    args = p.parse_args()
    check_model(p, args)
    batches = check_serving(p, args)

    started = time.perf_counter()
    rng = _common.seeded(args.seed)
    schedule = requests(rng, args.rounds, batches, args.min_prompt, args.max_prompt)
    dev = _common.device_of(args.device)
    data = torch.Generator().manual_seed(args.seed)

    positions = args.max_prompt + args.new_tokens
    config = llama_config(args.hidden, args.layers, args.heads, args.kv_heads, args.mlp, args.vocab, positions)
    model = load(config, dev, _common.dtype_of(args.dtype))
    with _common.shapes_only(dev):
        made = serve(model, schedule, args.new_tokens, args.vocab, data, dev)

    params = sum(t.numel() for t in model.parameters())
    _common.summary(
        "llama_generate",
        dev,
        started,
        device=dev,
        params_m=f"{params / 1e6:.1f}",
        rounds=args.rounds,
        batches="/".join(str(b) for b, _ in schedule),
        prompts="/".join(str(n) for _, n in schedule),
        tokens=made,
    )


if __name__ == "__main__":
    main()
