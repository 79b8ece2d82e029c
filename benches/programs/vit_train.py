"""Vision Transformer training for image classification, an epoch's last batch smaller.

Models: training a ViT (transformers' ViTForImageClassification, random
weights, by default 224 x 224 images in 16 x 16 patches, 6 layers, 384 wide,
6 heads, MLP 1536, 100 classes: about 11 M parameters, a shallow ViT-S/16)
with AdamW (lr 1e-3, weight decay 0.05) and bfloat16 autocast. Images come
as a data loader with pin_memory=True gives them: a float32 batch in pinned
host memory, copied to the device without blocking. The patch embedding is a
convolution, which takes torch's native (non-cuDNN) path.

Shape schedule: --steps steps of --batch images, then one last batch of
--last-batch images (an epoch whose size is not a multiple of the batch,
drop_last=False): every step but the last has the same shapes.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import torch  # noqa: E402
from transformers import ViTConfig, ViTForImageClassification  # noqa: E402


def host_images(gen, batch, size):
    """One batch of images on the host."""
    return torch.randn(batch, 3, size, size, generator=gen)


def main():
    p = _common.parser(__doc__, steps=6)
    p.add_argument("--batch", type=int, default=64, help="images per step (default 64)")
    p.add_argument("--last-batch", type=int, default=40, help="images in the last step (default 40; 0: none)")
    p.add_argument("--image", type=int, default=224, help="image side in pixels (default 224)")
    p.add_argument("--patch", type=int, default=16, help="patch side in pixels (default 16)")
    p.add_argument("--layers", type=int, default=6, help="encoder layers (default 6)")
    p.add_argument("--hidden", type=int, default=384, help="model width (default 384)")
    p.add_argument("--heads", type=int, default=6, help="attention heads (default 6)")
    p.add_argument("--classes", type=int, default=100, help="classes (default 100)")
    p.add_argument("--amp", choices=["bf16", "none"], default="bf16", help="autocast (default bf16)")
    args = p.parse_args()
    _common.positive(p, args, "steps", "batch", "image", "patch", "layers", "hidden", "heads", "classes")
    if args.last_batch < 0:
        p.error("--last-batch must not be negative")
    if args.image % args.patch:
        p.error("--image must be a multiple of --patch")
    if args.hidden % args.heads:
        p.error("--hidden must be a multiple of --heads")

    started = time.perf_counter()
    _common.seeded(args.seed)
    dev = _common.device_of(args.device)
    data = torch.Generator().manual_seed(args.seed)
    batches = [args.batch] * args.steps + ([args.last_batch] if args.last_batch else [])

    config = ViTConfig(
        image_size=args.image,
        patch_size=args.patch,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        num_labels=args.classes,
        problem_type="single_label_classification",
        attn_implementation="sdpa",
    )
    model = ViTForImageClassification(config).to(dev)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    total = torch.zeros((), device=dev)
    with _common.shapes_only(dev):
        for batch in batches:
            images = _common.to_device(host_images(data, batch, args.image), dev)
            labels = _common.to_device(torch.randint(args.classes, (batch,), generator=data), dev)
            with _common.autocast(dev, args.amp):
                loss = model(pixel_values=images, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += loss.detach()

    params = sum(t.numel() for t in model.parameters())
    _common.summary(
        "vit_train",
        dev,
        started,
        device=dev,
        params_m=f"{params / 1e6:.1f}",
        steps=len(batches),
        batches="/".join(str(b) for b in batches),
        mean_loss=_common.number(total / len(batches)),
    )


if __name__ == "__main__":
    main()
