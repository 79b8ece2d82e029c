"""A local chat application switching models: one Llama-style model serves, is unloaded, and a wider one is loaded and serves.

Models: what a local chat front end (text-generation-webui's "unload, then
load") does when the user picks another model: the first model (by default
8 layers, 1024 wide, MLP 2816, bfloat16: about 150 M parameters) answers
--rounds batches of requests with greedy decoding and a growing KV cache
(llama_generate.generate), is unloaded (its cache and every reference
dropped, `del`, `gc.collect()`, then `torch.cuda.empty_cache()` as such
applications do unless --keep-cache), and a wider model (by default 8 layers,
1536 wide, MLP 4096: about 330 M parameters) is loaded and answers the same
number of rounds. With --keep-cache the first model's freed memory stays in
the allocator's cache, and the wider model's tensors, of other sizes, must
be placed around it.

Shape schedule: as llama_generate, drawn (seeded) once per model: batch
sizes from --batches, prompt lengths from [--min-prompt, --max-prompt],
--new-tokens tokens per round, no padding, no host read of a device value.
"""

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import llama_generate as llama  # noqa: E402

import torch  # noqa: E402


def main():
    p = _common.parser(__doc__)
    llama.add_serving_arguments(p, rounds=6)
    p.add_argument("--first-hidden", type=int, default=1024, help="first model's width (default 1024)")
    p.add_argument("--first-mlp", type=int, default=2816, help="first model's MLP width (default 2816)")
    p.add_argument("--second-hidden", type=int, default=1536, help="second model's width (default 1536)")
    p.add_argument("--second-mlp", type=int, default=4096, help="second model's MLP width (default 4096)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of both (default 8)")
    p.add_argument("--head-dim", type=int, default=64, help="attention head width of both (default 64)")
    p.add_argument("--kv-groups", type=int, default=4, help="query heads per key/value head (default 4)")
    p.add_argument("--keep-cache", action="store_true", help="unload without torch.cuda.empty_cache()")
    args = p.parse_args()
    batches = llama.check_serving(p, args)
    _common.positive(p, args, "first_hidden", "first_mlp", "second_hidden", "second_mlp", "layers", "head_dim", "kv_groups")
    for hidden in (args.first_hidden, args.second_hidden):
        if hidden % (args.head_dim * args.kv_groups):
            p.error("each width must be a multiple of --head-dim x --kv-groups")

    started = time.perf_counter()
    rng = _common.seeded(args.seed)
    dev = _common.device_of(args.device)
    data = torch.Generator().manual_seed(args.seed)
    dtype = _common.dtype_of(args.dtype)
    positions = args.max_prompt + args.new_tokens

    served = []
    for hidden, mlp in ((args.first_hidden, args.first_mlp), (args.second_hidden, args.second_mlp)):
        heads = hidden // args.head_dim
        schedule = llama.requests(rng, args.rounds, batches, args.min_prompt, args.max_prompt)
        config = llama.llama_config(hidden, args.layers, heads, heads // args.kv_groups, mlp, args.vocab, positions)
        model = llama.load(config, dev, dtype)
        with _common.shapes_only(dev):
            made = llama.serve(model, schedule, args.new_tokens, args.vocab, data, dev)
        served.append(f"{sum(t.numel() for t in model.parameters()) / 1e6:.1f}M:{made}")
        # Unloading, as the application does.
        del model
        gc.collect()
        if dev.type == "cuda" and not args.keep_cache:
            torch.cuda.empty_cache()

    _common.summary(
        "model_switch",
        dev,
        started,
        device=dev,
        models_tokens="/".join(served),
        rounds=args.rounds,
        empty_cache=not args.keep_cache,
    )


if __name__ == "__main__":
    main()
