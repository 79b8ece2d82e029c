#!/usr/bin/env python3
"""Write three kinds of synthetic multi-stream traces in the converted trace format
(`a ID SIZE STREAM`, `f ID`; see ../shared/traces/README.md), for measuring
what stream handling costs where the real traces have one or two streams:

- `pipeline-N.trace`: pipelined inference, as converted from a PyTorch
  snapshot: a 32-layer model (hidden 4096) whose first 8 layers stay
  resident, the others prefetched three layers ahead on N - 1 side streams
  in turn and freed on the stream that allocated them (a converted trace has
  no `record_stream`); per layer, small activations on the compute stream
  (stream 0); 20 forward passes of 1 to 128 tokens.
- `staging-N.trace`: as `pipeline-N`, but each prefetched weight is first
  copied into a staging buffer on its side stream, converted from there
  into its own tensor (a dtype cast or a dequantisation after the
  host-to-device copy) and the staging buffer freed at once on that side
  stream: every side stream frees memory the next one wants.
- With `--wide`, `pipeline-wide-N.trace` and `staging-wide-N.trace`: the
  same at Llama-2-70B's widths (hidden 8192, FFN 28672; 32 layers, 20 GiB
  at the peak): weight tensors of 128 to 448 MiB, a few hundred pages each.
  `pipeline-wide-10` is the closest stand-in here for the held-out 10-stream
  inference trace of issue 25 (about 20 GiB at its peak, classic's
  efficiency 0.65 against 0.67 there, and, before events were recorded on
  demand, about 0.5 event records and 0.6 queries per operation, as there).
- `small-streams-10.trace`: 10 streams each allocating and freeing small and
  medium tensors (4 KiB to 6 MiB) in random turns, each freeing only what it
  allocated: frees on one stream that the others reuse within the GPU's lag.
- With `--idle-from DIR` (the real traces, `../shared/traces/converted`),
  for each real trace `NAME`: `NAME-idle.trace`, the trace with one 4 KiB
  block allocated on a second stream first and never freed (a stream used
  once, as a CUDA-graph warm-up or a one-off copy leaves); `NAME-side.trace`,
  the trace with an 8 MiB block allocated on a second stream every 1,500
  events past the pre-existing prefix and freed 50 events later (a side
  stream that comes back now and then); and a `stats.json` beside them
  that keeps each trace's pre-existing prefix.

- With `--family COUNT [FIRST]`, `family-SEED.trace` for COUNT seeds from
  FIRST (default 0) and a `family.json` of what each drew: traces no one
  tuned for, each drawn from how frameworks use streams: 2 to 32 streams;
  a model of 12 to 80 layers (hidden 1024 to 8192) whose first layers stay
  resident and the others are prefetched 1 to 6 layers ahead on side
  streams (in turn, at random, or by layer); optionally staging buffers,
  small tensors beside each weight on the side streams (scales, indices),
  activation sizes off any alignment, a KV cache growing on the compute
  stream and freed every second pass, a communication stream with
  buckets, a data-loader stream with batches, and frees out of order;
  2 to 8 passes of 1 to 512 tokens. Beside each, `family-SEED-one.trace`:
  the same events on stream 0 alone, to tell what the streams cost from
  what the layout costs.

Deterministic (fixed seeds). Usage:

    python3 scripts/multistream-traces.py OUT_DIR [N ...]   # N default: 10
    python3 scripts/multistream-traces.py OUT_DIR --wide [N ...]
    python3 scripts/multistream-traces.py OUT_DIR --idle-from ../shared/traces/converted
    python3 scripts/multistream-traces.py OUT_DIR --family COUNT [FIRST]

then, for instance,

    cargo run --release -p quilt-bench -- ab --iterations 5 --no-bisect \\
        --trace OUT_DIR/*.trace
"""

import json
import os
import random
import sys

# (hidden, FFN) widths: the default model's, and --wide's (Llama-2-70B's).
WIDTHS = (4096, 11008)
WIDE = (8192, 28672)
VOCAB = 32000
LAYERS = 32
RESIDENT = 8
AHEAD = 3
BF16 = 2


def layer_weights(hidden, ffn):
    return [
        hidden * BF16,
        3 * hidden * hidden * BF16,
        hidden * hidden * BF16,
        hidden * BF16,
        2 * ffn * hidden * BF16,
        ffn * hidden * BF16,
    ]


class Trace:
    def __init__(self):
        self.lines = []
        self.next_id = 0

    def alloc(self, size, stream):
        i = self.next_id
        self.next_id += 1
        self.lines.append(f"a {i} {size} {stream}")
        return i

    def free(self, i):
        self.lines.append(f"f {i}")

    def write(self, path):
        with open(path, "w") as f:
            f.write("\n".join(self.lines) + "\n")


def pipeline(streams, staging=False, widths=WIDTHS):
    hidden_size, ffn = widths
    weights_of_layer = layer_weights(hidden_size, ffn)
    rng = random.Random(7)
    t = Trace()
    for _ in range(RESIDENT):
        for w in weights_of_layer:
            t.alloc(w, 0)
    t.alloc(VOCAB * hidden_size * BF16, 0)
    side = 0
    for _ in range(20):
        tokens = rng.choice([1, 1, 1, 1, 16, 128])
        in_flight = []
        next_layer = RESIDENT
        hidden = t.alloc(tokens * hidden_size * BF16, 0)
        for layer in range(LAYERS):
            while next_layer < min(layer + AHEAD, LAYERS):
                s = 1 + side % (streams - 1)
                side += 1
                weights = []
                for w in weights_of_layer:
                    buffer = t.alloc(w, s) if staging else None
                    weights.append(t.alloc(w, s))
                    if buffer is not None:
                        t.free(buffer)
                in_flight.append(weights)
                next_layer += 1
            weights = in_flight.pop(0) if layer >= RESIDENT else []
            acts = []
            for size in [
                tokens * hidden_size * BF16,
                tokens * 3 * hidden_size * BF16,
                tokens * hidden_size * 4,
                tokens * hidden_size * BF16,
                tokens * 2 * ffn * BF16,
                tokens * ffn * BF16,
                tokens * hidden_size * BF16,
                8,
                4,
            ]:
                acts.append(t.alloc(size, 0))
                if len(acts) > 3:
                    t.free(acts.pop(0))
            for a in acts:
                t.free(a)
            for w in weights:
                t.free(w)
        logits = t.alloc(VOCAB * 4 * tokens, 0)
        t.free(logits)
        t.free(hidden)
    return t


def small_streams():
    rng = random.Random(11)
    t = Trace()
    for _ in range(30):
        t.alloc(rng.choice([1 << 20, 4 << 20, 16 << 20]), 0)
    live = {s: [] for s in range(10)}
    sizes = [4096, 16384, 65536, 131072, 524288, 2 << 20, 6 << 20]
    for _ in range(20000):
        s = rng.randrange(10)
        if live[s] and (len(live[s]) > 8 or rng.random() < 0.45):
            t.free(live[s].pop(rng.randrange(len(live[s]))))
        else:
            live[s].append(t.alloc(rng.choice(sizes), s))
    return t


def family_member(seed):
    """One trace of the family (see `--family`) and what it drew."""
    rng = random.Random(seed)
    drawn = dict(
        streams=rng.choice([2, 3, 4, 6, 8, 10, 10, 10, 16, 32]),
        hidden=rng.choice([1024, 2048, 4096, 5120, 8192]),
        ffn_ratio=rng.choice([2.6875, 3.5, 4]),
        layers=rng.choice([12, 24, 32, 40, 80]),
    )
    drawn.update(
        resident=rng.randrange(0, drawn["layers"] // 2 + 1),
        ahead=rng.choice([1, 2, 3, 4, 6]),
        weights=rng.choice([2, 6, 9, 12]),
        side_small=rng.random() < 0.5,
        staging=rng.random() < 0.3,
        unaligned=rng.random() < 0.5,
        kv_cache=rng.random() < 0.4,
        comm=rng.random() < 0.3 and drawn["streams"] > 2,
        loader=rng.random() < 0.3 and drawn["streams"] > 2,
        frees_out_of_order=rng.random() < 0.4,
        side_stream_by=rng.choice(["turn", "random", "layer"]),
        passes=rng.choice([2, 4, 8]),
    )
    d = drawn
    n, hidden = d["streams"], d["hidden"]
    ffn = int(hidden * d["ffn_ratio"])
    t = Trace()
    sizes = [hidden * hidden * BF16 * rng.choice([1, 3, 1, 1]) for _ in range(d["weights"] // 2)]
    sizes += [ffn * hidden * BF16 * rng.choice([1, 2]) for _ in range(d["weights"] - d["weights"] // 2)]
    sizes += [hidden * BF16] * rng.choice([0, 1, 2])
    for _ in range(d["resident"]):
        for w in sizes:
            t.alloc(w, 0)
    t.alloc(VOCAB * hidden * BF16, 0)
    # The last streams carry communication and data loading when drawn;
    # the side streams are the others (at least stream 1).
    comm = n - 1 if d["comm"] else None
    loader = n - 1 - int(d["comm"]) if d["loader"] else None
    side = list(range(1, max(2, n - int(d["comm"]) - int(d["loader"]))))
    kv, prefetched = [], 0
    for p in range(d["passes"]):
        tokens = rng.choice([1, 1, 7, 16, 128, 333, 512])
        batch = t.alloc(tokens * 4 * rng.choice([1, 3]), loader) if loader is not None else None
        hidden_state = t.alloc(tokens * hidden * BF16 + (rng.randrange(1, 64) if d["unaligned"] else 0), 0)
        in_flight, next_layer = [], d["resident"]
        for layer in range(d["layers"]):
            while next_layer < min(layer + d["ahead"], d["layers"]):
                s = {
                    "turn": side[prefetched % len(side)],
                    "random": rng.choice(side),
                    "layer": side[next_layer % len(side)],
                }[d["side_stream_by"]]
                prefetched += 1
                weights = []
                for w in sizes:
                    staging = t.alloc(w // rng.choice([1, 2, 4]), s) if d["staging"] else None
                    weights.append(t.alloc(w, s))
                    if d["side_small"]:
                        weights.append(t.alloc(rng.choice([hidden * 4, hidden // 8, 64, 4096]), s))
                    if staging is not None:
                        t.free(staging)
                in_flight.append(weights)
                next_layer += 1
            weights = in_flight.pop(0) if layer >= d["resident"] else []
            acts = []
            for m in [1, 3, 2, 1, 2 * ffn / hidden, ffn / hidden, 1]:
                size = tokens * hidden * BF16 * m + (rng.randrange(1, 4096) if d["unaligned"] else 0)
                acts.append(t.alloc(int(size), 0))
                if len(acts) > 3:
                    t.free(acts.pop(rng.randrange(len(acts)) if d["frees_out_of_order"] else 0))
            if d["kv_cache"]:
                kv.append(t.alloc(2 * tokens * hidden * BF16 + 64, 0))
            for a in acts:
                t.free(a)
            if d["frees_out_of_order"]:
                rng.shuffle(weights)
            for w in weights:
                t.free(w)
            if comm is not None and layer % 4 == 3:
                t.free(t.alloc(rng.choice([25 << 20, 50 << 20, 4 << 20]), comm))
        if batch is not None:
            t.free(batch)
        t.free(hidden_state)
        t.free(t.alloc(VOCAB * 4 * tokens, 0))
        if d["kv_cache"] and p % 2 == 1:
            for k in kv:
                t.free(k)
            kv = []
    for k in kv:
        t.free(k)
    return t, drawn


def family(out, count, first):
    """`family-SEED.trace` for `count` seeds from `first`, and `family.json`."""
    drawn = []
    for seed in range(first, first + count):
        t, d = family_member(seed)
        name = f"family-{seed:03d}"
        t.write(os.path.join(out, name + ".trace"))
        drawn.append(dict(name=name, events=len(t.lines), **d))
        one = Trace()
        one.lines = [" ".join(line.split()[:3] + ["0"]) if line[0] == "a" else line for line in t.lines]
        one.write(os.path.join(out, name + "-one.trace"))
    with open(os.path.join(out, "family.json"), "w") as f:
        json.dump(drawn, f, indent=1)


def second_stream_variants(src, out):
    """Each real trace of `src` as `-idle` and `-side` (see above)."""
    with open(os.path.join(src, "stats.json")) as f:
        stats = json.load(f)
    kept = []
    for entry in stats:
        with open(os.path.join(src, entry["file"])) as f:
            events = [line.split() for line in f if line.strip()]
        pre = entry["preexisting_allocs"]
        # -idle: one block on stream 1 first (part of the prefix).
        lines = ["a 0 4096 1"]
        lines += [" ".join([e[0], str(int(e[1]) + 1)] + e[2:]) for e in events]
        variants = [("-idle", lines, pre + 1)]
        # -side: 8 MiB on stream 1 every 1,500 events, freed 50 later.
        lines, ids, pending, next_id = [], {}, [], 0
        for i, e in enumerate(events):
            if e[0] == "a":
                ids[e[1]] = next_id
                lines.append(f"a {next_id} {e[2]} {e[3]}")
                next_id += 1
            else:
                lines.append(f"f {ids[e[1]]}")
            if i >= pre and i % 1500 == 0:
                lines.append(f"a {next_id} {8 << 20} 1")
                pending.append((i + 50, next_id))
                next_id += 1
            while pending and pending[0][0] <= i:
                lines.append(f"f {pending.pop(0)[1]}")
        lines += [f"f {k}" for _, k in pending]
        variants.append(("-side", lines, pre))
        for suffix, lines, prefix in variants:
            name = entry["name"] + suffix
            with open(os.path.join(out, name + ".trace"), "w") as f:
                f.write("\n".join(lines) + "\n")
            kept.append(
                dict(
                    entry,
                    name=name,
                    file=name + ".trace",
                    preexisting_allocs=prefix,
                    streams=entry["streams"] + 1,
                )
            )
    with open(os.path.join(out, "stats.json"), "w") as f:
        json.dump(kept, f, indent=1)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    if sys.argv[2:3] == ["--idle-from"]:
        if len(sys.argv) != 4:
            sys.exit("multistream-traces: --idle-from takes the folder of the real traces")
        os.makedirs(out, exist_ok=True)
        try:
            second_stream_variants(sys.argv[3], out)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"multistream-traces: reading the real traces: {e}")
        return
    if sys.argv[2:3] == ["--family"]:
        usage = "multistream-traces: --family takes COUNT (at least 1) and an optional FIRST seed"
        try:
            count, first = ([int(a) for a in sys.argv[3:5]] + [0])[:2]
        except ValueError:
            sys.exit(usage)
        if len(sys.argv) not in (4, 5) or count < 1 or first < 0:
            sys.exit(usage)
        os.makedirs(out, exist_ok=True)
        family(out, count, first)
        return
    args = sys.argv[2:]
    wide = args[:1] == ["--wide"]
    try:
        counts = [int(n) for n in args[1:] if wide] or [int(n) for n in args if not wide] or [10]
    except ValueError:
        sys.exit(f"multistream-traces: N must be a number (got {' '.join(args)})")
    if any(n < 2 for n in counts):
        sys.exit("multistream-traces: N must be at least 2")
    os.makedirs(out, exist_ok=True)
    kind, widths = ("-wide", WIDE) if wide else ("", WIDTHS)
    for n in counts:
        pipeline(n, widths=widths).write(os.path.join(out, f"pipeline{kind}-{n}.trace"))
        pipeline(n, staging=True, widths=widths).write(
            os.path.join(out, f"staging{kind}-{n}.trace")
        )
    if not wide:
        small_streams().write(os.path.join(out, "small-streams-10.trace"))


if __name__ == "__main__":
    main()
