"""BERT fine-tuning for sequence classification on padded batches of varying length.

Models: fine-tuning a BERT encoder (transformers' BertForSequenceClassification,
random weights, by default 6 layers, 512 wide, 8 heads, BERT's vocabulary of
30,522, 3 labels: about 35 M parameters) with AdamW (lr 2e-5, weight decay
0.01) and a linear warm-up and decay of the learning rate, in float32, as a
GLUE-style fine-tuning script does.

Shape schedule: --steps steps of --batch examples; each example's length is
drawn (seeded) from a long-tailed (log-normal) distribution of median
--median-len, clipped to [8, --max-len]; a batch is padded to its longest
example rounded up to a multiple of 8 (DataCollatorWithPadding's
pad_to_multiple_of=8), so the padded length changes from batch to batch and
the padding's share with it. Token ids, token types, the 2-D padding mask
and the labels are made on the host and copied to the device.

The padding mask becomes the 4-D boolean mask transformers' SDPA path builds
(masking_utils.sdpa_mask, batch x 1 x length x length) on the device; the
only difference from transformers' own call is where the "does this batch
have padding?" answer comes from: transformers asks the device (a read that
sees garbage on the simulated GPU), the program knows it from the lengths.
No host decision reads a device value (_common.shapes_only).
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup  # noqa: E402
from transformers.masking_utils import bidirectional_mask_function, sdpa_mask  # noqa: E402


def batch_lengths(rng, batch, median, longest):
    """The lengths of one batch's examples, long-tailed around the median."""
    mu = math.log(median)
    return [min(longest, max(8, int(rng.lognormvariate(mu, 0.6)))) for _ in range(batch)]


def padded_batch(gen, lengths, vocab, labels, multiple=8):
    """Host tensors of one batch: ids (0 is [PAD]), token types, the 2-D
    padding mask (1 for a token, 0 for padding) and the labels."""
    width = -(-max(lengths) // multiple) * multiple
    ids = torch.randint(1, vocab, (len(lengths), width), generator=gen)
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids.masked_fill(~keep, 0)
    types = torch.zeros_like(ids)
    targets = torch.randint(labels, (len(lengths),), generator=gen)
    return ids, types, keep.long(), targets


def attention_mask(keep, has_padding, dev):
    """What transformers' SDPA mask builder makes of the 2-D mask (on the
    device): nothing where no example is padded, else the batch x 1 x length
    x length mask."""
    if not has_padding:
        return None
    batch, width = keep.shape
    return sdpa_mask(
        batch_size=batch,
        q_length=width,
        kv_length=width,
        mask_function=bidirectional_mask_function,
        attention_mask=keep.to(torch.bool),
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        device=dev,
    )


def main():
    p = _common.parser(__doc__, steps=24)
    p.add_argument("--batch", type=int, default=32, help="examples per batch (default 32)")
    p.add_argument("--median-len", type=int, default=96, help="median example length (default 96)")
    p.add_argument("--max-len", type=int, default=512, help="longest example (default 512)")
    p.add_argument("--layers", type=int, default=6, help="encoder layers (default 6)")
    p.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--labels", type=int, default=3, help="classes (default 3)")
    args = p.parse_args()
    _common.positive(p, args, "steps", "batch", "median_len", "max_len", "layers", "hidden", "heads", "labels")
    if args.max_len < 8 or args.max_len % 8:
        p.error("--max-len must be a multiple of 8")
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")

    started = time.perf_counter()
    rng = _common.seeded(args.seed)
    schedule = [batch_lengths(rng, args.batch, args.median_len, args.max_len) for _ in range(args.steps)]
    dev = _common.device_of(args.device)
    data = torch.Generator().manual_seed(args.seed)

    config = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.max_len,
        num_labels=args.labels,
        problem_type="single_label_classification",
        attn_implementation="sdpa",
    )
    model = BertForSequenceClassification(config).to(dev)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, max(1, args.steps // 10), args.steps)

    total = torch.zeros((), device=dev)
    widths = []
    with _common.shapes_only(dev):
        for lengths in schedule:
            ids, types, keep, targets = padded_batch(data, lengths, config.vocab_size, args.labels)
            widths.append(ids.shape[1])
            keep = _common.to_device(keep, dev)
            mask = attention_mask(keep, min(lengths) < ids.shape[1], dev)
            out = model(
                input_ids=_common.to_device(ids, dev),
                token_type_ids=_common.to_device(types, dev),
                attention_mask=mask,
                labels=_common.to_device(targets, dev),
            )
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total += out.loss.detach()

    params = sum(t.numel() for t in model.parameters())
    _common.summary(
        "bert_finetune",
        dev,
        started,
        device=dev,
        params_m=f"{params / 1e6:.1f}",
        steps=args.steps,
        batch=args.batch,
        padded=f"{min(widths)}..{max(widths)}",
        mean_loss=_common.number(total / args.steps),
    )


if __name__ == "__main__":
    main()
