//! `many-streams-N`: `N` streams that keep to themselves, as several
//! inference workers (or pipeline stages, or tenants) sharing one device
//! and one allocator do: each stream allocates and frees its own blocks on
//! itself, and no block crosses streams (no `record_stream`), so the memory
//! the streams share is only the allocator's: what one stream frees another
//! may be given. `many-streams-handoff-N` adds a few cross-stream
//! hand-offs: once per pass a stream's output is used by the next stream
//! (`record_stream`), and still freed by the stream that made it.
//!
//! - Models: stream `s` runs a transformer of hidden size
//!   [`HIDDENS`]`[s % 4]` (1,024 to 3,072; MLP 4 x hidden; heads of 128)
//!   over [`LAYERS`] layers, in bf16. Resident throughout, on its stream:
//!   its embedding and its share of [`RESIDENT_BYTES`] (the same total
//!   whatever `N`), as whole layers.
//! - Per pass (a batch of tokens, log-normal, median 512, 64 to 2,048,
//!   drawn per stream and pass): per layer, the next layer's weights are
//!   prefetched on the stream ([`PREFETCH`] layers ahead: two norms, QKV,
//!   output, MLP up and down), the layer's activations are made and freed
//!   as in `inference_layer`, a few small buffers (masks, indices,
//!   scalars: 8 B to 64 KiB) live for the layer, and the layer's weights
//!   are freed after its kernels are queued. Logits and sampled ids end a
//!   pass.
//! - Interleaving: the streams run at once; the trace takes their events in
//!   runs of 1 to [`MAX_RUN`] from a stream drawn at random, as host
//!   threads issuing work concurrently do.
//! - Scale: [`TOTAL_PASSES`] passes over all streams (each stream makes
//!   `TOTAL_PASSES / N`, at least 2), so the variants differ in their
//!   stream count, not in their length.
//!
//! Registered for 4, 10 and 32 streams (`many-streams-4`, `-10`, `-32`),
//! and the hand-off variant for the same (`many-streams-handoff-4`, ...).

use rand::RngExt;

use super::{inference_layer, lognormal, rng_for, TraceBuilder, Transformer, BF16, FP32, I64};
use crate::trace::{Event, Trace};

/// Hidden sizes of the streams' models, by stream index modulo 4.
pub const HIDDENS: [u64; 4] = [2048, 1024, 3072, 1536];
/// Layers per model.
pub const LAYERS: u64 = 8;
/// Layers prefetched ahead of the one computed.
pub const PREFETCH: u64 = 1;
/// Resident weights over all streams (the same whatever the stream count).
pub const RESIDENT_BYTES: u64 = 12 << 30;
/// Passes over all streams.
pub const TOTAL_PASSES: u64 = 64;
/// Most events taken from one stream in a run.
pub const MAX_RUN: usize = 6;

/// The model stream `s` runs.
fn model_of(s: u64) -> Transformer {
    let hidden = HIDDENS[(s % 4) as usize];
    Transformer {
        layers: LAYERS,
        hidden,
        kv_dim: hidden,
        ffn: 4 * hidden,
        vocab: 32000,
        heads: hidden / 128,
        gated: false,
    }
}

/// The weight tensors (bytes) of one layer of `m`, in load order.
fn layer_weights(m: &Transformer) -> [u64; 6] {
    let h = m.hidden;
    [
        h * BF16,         // input norm
        3 * h * h * BF16, // QKV
        h * h * BF16,     // output projection
        h * BF16,         // post-attention norm
        m.ffn * h * BF16, // MLP up
        h * m.ffn * BF16, // MLP down
    ]
}

/// One stream's events (ids its own, from 0), its resident weights first
/// (`preexisting` events).
struct StreamEvents {
    events: Vec<Event>,
    preexisting: usize,
}

/// The events of stream `s` (of `n`) over `passes` passes.
fn stream_events(s: u64, n: u64, passes: u64, handoff: bool, seed: u64) -> StreamEvents {
    let m = model_of(s);
    let mut rng = rng_for(seed, 0x3A11_57E0 ^ s);
    let mut b = TraceBuilder::new();
    // Resident: the embedding and this stream's share of the resident
    // layers.
    b.alloc(m.vocab * m.hidden * BF16, s);
    let layer_bytes: u64 = layer_weights(&m).iter().sum();
    let resident_layers = (RESIDENT_BYTES / n / layer_bytes).max(1);
    for _ in 0..resident_layers {
        for w in layer_weights(&m) {
            b.alloc(w, s);
        }
    }
    b.end_preexisting();
    let next = (s + 1) % n;
    for _ in 0..passes {
        let tokens = lognormal(&mut rng, 512.0, 0.8, 64, 2048);
        let hidden = b.alloc(tokens * m.hidden * BF16, s);
        let mut in_flight: std::collections::VecDeque<Vec<u64>> = Default::default();
        let mut fetched = 0;
        for layer in 0..m.layers {
            while fetched < (layer + 1 + PREFETCH).min(m.layers) {
                in_flight.push_back(layer_weights(&m).iter().map(|&w| b.alloc(w, s)).collect());
                fetched += 1;
            }
            let weights = in_flight.pop_front().unwrap_or_default();
            let small: Vec<u64> = (0..rng.random_range(1..=3u32))
                .map(|_| b.alloc(lognormal(&mut rng, 2048.0, 1.5, 8, 64 << 10), s))
                .collect();
            inference_layer(&mut b, &m, tokens, tokens, s);
            b.free_all(&small);
            b.free_all(&weights);
        }
        let logits = b.alloc(tokens.min(256) * m.vocab * FP32, s);
        let ids = b.alloc(tokens * I64, s);
        b.free(logits);
        if handoff && n > 1 {
            // The pass's output goes to the next stream, which reads it
            // there; the stream that made it frees it.
            let out = b.alloc(tokens * m.hidden * BF16, s);
            b.record_stream(out, next);
            b.free(hidden);
            b.free(ids);
            b.free(out);
        } else {
            b.free(hidden);
            b.free(ids);
        }
    }
    let t = b.finish("");
    StreamEvents {
        events: t.events,
        preexisting: t.preexisting,
    }
}

/// An event of a stream's own trace with its ids moved up by `base`.
fn shifted(e: &Event, base: u64) -> Event {
    match *e {
        Event::Alloc { id, size, stream } => Event::Alloc {
            id: id + base,
            size,
            stream,
        },
        Event::Free { id } => Event::Free { id: id + base },
        Event::RecordStream { id, stream } => Event::RecordStream {
            id: id + base,
            stream,
        },
        other => other,
    }
}

/// Generate the trace on `n` streams (at least 1) for `seed`, with
/// hand-offs or without.
pub fn generate_on(n: u64, handoff: bool, seed: u64) -> Trace {
    let n = n.max(1);
    let passes = (TOTAL_PASSES / n).max(2);
    let streams: Vec<StreamEvents> = (0..n)
        .map(|s| stream_events(s, n, passes, handoff, seed))
        .collect();
    // Ids: each stream's own, moved past the streams before it.
    let mut bases = Vec::with_capacity(streams.len());
    let mut next_base = 0;
    for st in &streams {
        bases.push(next_base);
        next_base += st
            .events
            .iter()
            .filter(|e| matches!(e, Event::Alloc { .. }))
            .count() as u64;
    }
    let mut events = Vec::new();
    // The resident weights of every stream first: the pre-existing prefix.
    for (st, &base) in streams.iter().zip(&bases) {
        events.extend(st.events[..st.preexisting].iter().map(|e| shifted(e, base)));
    }
    let preexisting = events.len();
    // Then the streams' passes, in runs of 1 to MAX_RUN events from a
    // stream drawn at random among those with events left.
    let mut rng = rng_for(seed, 0x3A11_57E1);
    let mut at: Vec<usize> = streams.iter().map(|st| st.preexisting).collect();
    let mut open: Vec<usize> = (0..streams.len())
        .filter(|&i| at[i] < streams[i].events.len())
        .collect();
    while !open.is_empty() {
        let k = rng.random_range(0..open.len());
        let i = open[k];
        let run = rng.random_range(1..=MAX_RUN);
        let st = &streams[i];
        let end = (at[i] + run).min(st.events.len());
        events.extend(st.events[at[i]..end].iter().map(|e| shifted(e, bases[i])));
        at[i] = end;
        if end == st.events.len() {
            open.swap_remove(k);
        }
    }
    // Ids in allocation order, as every trace has them.
    let mut renumber = std::collections::HashMap::new();
    for e in &mut events {
        match e {
            Event::Alloc { id, .. } => {
                let new = renumber.len() as u64;
                renumber.insert(*id, new);
                *id = new;
            }
            Event::Free { id } | Event::RecordStream { id, .. } => {
                *id = renumber.get(id).copied().unwrap_or(*id);
            }
            _ => {}
        }
    }
    let name = if handoff {
        format!("many-streams-handoff-{n}")
    } else {
        format!("many-streams-{n}")
    };
    Trace {
        name,
        events,
        preexisting,
    }
}

/// `many-streams-4`.
pub fn generate_4(seed: u64) -> Trace {
    generate_on(4, false, seed)
}

/// `many-streams-10`.
pub fn generate_10(seed: u64) -> Trace {
    generate_on(10, false, seed)
}

/// `many-streams-32`.
pub fn generate_32(seed: u64) -> Trace {
    generate_on(32, false, seed)
}

/// `many-streams-handoff-4`.
pub fn generate_handoff_4(seed: u64) -> Trace {
    generate_on(4, true, seed)
}

/// `many-streams-handoff-10`.
pub fn generate_handoff_10(seed: u64) -> Trace {
    generate_on(10, true, seed)
}

/// `many-streams-handoff-32`.
pub fn generate_handoff_32(seed: u64) -> Trace {
    generate_on(32, true, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_is_freed_on_the_stream_that_made_it_and_only_handoffs_cross() {
        for handoff in [false, true] {
            let t = generate_on(10, handoff, 1);
            let mut stream_of = std::collections::HashMap::new();
            let mut records = 0;
            for e in &t.events {
                match *e {
                    Event::Alloc { id, stream, .. } => {
                        stream_of.insert(id, stream);
                    }
                    Event::RecordStream { id, stream } => {
                        records += 1;
                        assert_ne!(stream_of[&id], stream);
                    }
                    _ => {}
                }
            }
            let streams: std::collections::HashSet<u64> = stream_of.values().copied().collect();
            assert_eq!(streams.len(), 10);
            if handoff {
                // One hand-off per stream and pass.
                assert_eq!(records, 10 * (TOTAL_PASSES / 10));
            } else {
                assert_eq!(records, 0);
            }
        }
    }
}
