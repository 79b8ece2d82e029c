//! `offload-pipeline-N`: pipelined inference of a model too large for the
//! device, its later layers streamed in on side (copy) streams while the
//! compute stream runs, as offloading runtimes (DeepSpeed ZeRO-Inference,
//! FlexGen, Accelerate's CPU offload with prefetching) do. `N` is the number
//! of streams: the compute stream (0) and `N - 1` copy streams.
//!
//! - Model: Llama-2-13B in bf16 with fused projections (per layer: QKV 150
//!   MiB, output 50 MiB, gate-and-up 270 MiB, down 135 MiB, two 10 KiB norms;
//!   605 MiB a layer). Live throughout, on the compute stream: the embedding,
//!   the final norm, the output head and the first [`RESIDENT_LAYERS`]
//!   layers (10.1 GB). The other 24 layers are streamed in for every forward
//!   pass.
//! - Prefetch: a streamed layer's weights are allocated on the next copy
//!   stream in turn (a rotating pool of `N - 1` copy streams), at most
//!   [`DEPTH`] layers ahead of the layer being computed (the bounded
//!   prefetch depth: four layers, 2.4 GB, whatever `N`, so that the variants
//!   differ only in their stream count). The compute stream uses them
//!   (`record_stream` on stream 0 for each weight, as PyTorch code must when
//!   a tensor made on one stream is used on another) and they are freed after
//!   the layer's kernels are queued: every such free crosses streams.
//! - Compute: per layer, the activations of `inference_layer` on stream 0
//!   (hidden state, QKV, attention scores, MLP intermediates), then fp32
//!   logits and the sampled ids at the end of a pass.
//! - The loop body: [`BATCHES`] batches, each of 4 to 8 requests (prompts
//!   log-normal, median 384 tokens, 32 to 1536), with per-request K and V
//!   caches for prompt plus 64 generated tokens allocated on stream 0 when
//!   the batch starts and freed when it ends; one prefill pass (every prompt
//!   token at once) and [`DECODE_STEPS`] decode passes (one token per request).
//!
//! Registered for 4, 10 and 32 streams (`offload-pipeline-4`, `-10`, `-32`).

use super::{inference_layer, lognormal, rng_for, TraceBuilder, Transformer, BF16, FP32, I64};
use crate::trace::Trace;
use rand::RngExt;

/// Llama-2-13B.
const LLAMA_13B: Transformer = Transformer {
    layers: 40,
    hidden: 5120,
    kv_dim: 5120,
    ffn: 13824,
    vocab: 32000,
    heads: 40,
    gated: true,
};

/// Layers kept on the device; the rest are streamed in every pass.
pub const RESIDENT_LAYERS: u64 = 16;
/// Streamed layers in flight at most (prefetched ahead of, or being used by, the compute stream).
pub const DEPTH: u64 = 4;
/// Batches in the loop body.
pub const BATCHES: usize = 2;
/// Decode passes per batch (after its prefill pass).
pub const DECODE_STEPS: u64 = 3;
/// Tokens generated per request that its KV cache holds room for.
const GENERATED: u64 = 64;
/// The compute stream.
const COMPUTE: u64 = 0;

/// The weight tensors (bytes) of one layer of `m` with fused projections, in load order.
fn layer_weights(m: &Transformer) -> [u64; 6] {
    let h = m.hidden;
    [
        h * BF16,                      // input norm
        (h + 2 * m.kv_dim) * h * BF16, // fused QKV
        h * h * BF16,                  // output projection
        h * BF16,                      // post-attention norm
        2 * m.ffn * h * BF16,          // fused gate and up
        h * m.ffn * BF16,              // down
    ]
}

/// The prefetcher: which layers are in flight, and the copy stream next in turn.
struct Prefetch {
    copy_streams: u64,
    next_stream: u64,
    /// Streamed layers prefetched and not yet used: (layer, weight ids).
    in_flight: std::collections::VecDeque<(u64, Vec<u64>)>,
    /// The next streamed layer to prefetch.
    next_layer: u64,
}

impl Prefetch {
    /// Prefetch every streamed layer below `upto` not yet prefetched.
    fn fill(&mut self, b: &mut TraceBuilder, m: &Transformer, upto: u64) {
        while self.next_layer < upto.min(m.layers) {
            let stream = 1 + self.next_stream % self.copy_streams;
            self.next_stream += 1;
            let ids = layer_weights(m)
                .iter()
                .map(|&w| b.alloc(w, stream))
                .collect();
            self.in_flight.push_back((self.next_layer, ids));
            self.next_layer += 1;
        }
    }
}

/// One forward pass over `tokens` tokens (attention over `context` keys) for
/// `batch` requests: resident layers from memory, streamed layers prefetched
/// on the copy streams, used and freed on the compute stream.
fn forward(
    b: &mut TraceBuilder,
    m: &Transformer,
    p: &mut Prefetch,
    tokens: u64,
    context: u64,
    batch: u64,
) {
    p.next_layer = RESIDENT_LAYERS;
    let hidden = b.alloc(tokens * m.hidden * BF16, COMPUTE);
    for layer in 0..m.layers {
        // Keep DEPTH streamed layers in flight, counting the one in use.
        p.fill(b, m, layer + DEPTH);
        let weights = if layer >= RESIDENT_LAYERS {
            let (l, ids) = p.in_flight.pop_front().unwrap_or_default();
            debug_assert_eq!(l, layer);
            for &id in &ids {
                b.record_stream(id, COMPUTE);
            }
            ids
        } else {
            Vec::new()
        };
        inference_layer(b, m, tokens, context, COMPUTE);
        b.free_all(&weights);
    }
    let logits = b.alloc(batch * m.vocab * FP32, COMPUTE);
    let ids = b.alloc(batch * I64, COMPUTE);
    b.free(logits);
    b.free(hidden);
    b.free(ids);
}

/// Generate the trace on `streams` streams (at least 2) for `seed`.
pub fn generate_on(streams: u64, seed: u64) -> Trace {
    let m = LLAMA_13B;
    // One salt for every stream count: the variants draw the same batches.
    let mut rng = rng_for(seed, 0x0FF1_0AD0);
    let mut b = TraceBuilder::new();
    // Resident: embedding, the first layers, final norm, head.
    let mut params = vec![m.vocab * m.hidden * BF16];
    for _ in 0..RESIDENT_LAYERS {
        params.extend(layer_weights(&m));
    }
    params.push(m.hidden * BF16);
    params.push(m.vocab * m.hidden * BF16);
    for size in params {
        b.alloc(size, COMPUTE);
    }
    b.end_preexisting();
    let mut p = Prefetch {
        copy_streams: streams.max(2) - 1,
        next_stream: 0,
        in_flight: Default::default(),
        next_layer: RESIDENT_LAYERS,
    };
    let per_token = m.kv_bytes_per_token();
    for _ in 0..BATCHES {
        let batch = rng.random_range(4..=8u64);
        let prompts: Vec<u64> = (0..batch)
            .map(|_| lognormal(&mut rng, 384.0, 0.7, 32, 1536))
            .collect();
        let caches: Vec<u64> = prompts
            .iter()
            .flat_map(|&len| {
                let bytes = (len + GENERATED) * per_token;
                [bytes, bytes]
            })
            .map(|bytes| b.alloc(bytes, COMPUTE))
            .collect();
        let total: u64 = prompts.iter().sum();
        let longest = prompts.iter().copied().max().unwrap_or(1);
        forward(&mut b, &m, &mut p, total, longest, batch);
        for step in 1..=DECODE_STEPS {
            forward(&mut b, &m, &mut p, batch, longest + step, batch);
        }
        b.free_all(&caches);
    }
    b.finish(&format!("offload-pipeline-{streams}"))
}

/// `offload-pipeline-4`: the compute stream and 3 copy streams.
pub fn generate_4(seed: u64) -> Trace {
    generate_on(4, seed)
}

/// `offload-pipeline-10`: the compute stream and 9 copy streams.
pub fn generate_10(seed: u64) -> Trace {
    generate_on(10, seed)
}

/// `offload-pipeline-32`: the compute stream and 31 copy streams.
pub fn generate_32(seed: u64) -> Trace {
    generate_on(32, seed)
}
