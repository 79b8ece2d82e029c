//! Built-in workload generators: synthetic traces of the workloads that fragment
//! GPU memory, deterministic for a seed.
//!
//! Every generator returns a [`Trace`] whose pre-existing prefix is the memory
//! that lives throughout (model weights, optimizer state), so an iterated replay
//! keeps it outside the loop. Sizes are those of real models at real shapes;
//! `docs/workloads.md` gives the figures.

use std::collections::HashMap;

use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

use crate::trace::{Event, Trace};

pub mod llm_serving;
pub mod llm_serving_growable;
pub mod many_streams;
pub mod mixed_vision_language;
pub mod model_switch;
pub mod offload_pipeline;
pub mod train_varlen;

/// A built-in workload: its name, what it models, and its generator.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// Name used on the command line and in reports.
    pub name: &'static str,
    /// One line on what it models.
    pub description: &'static str,
    /// Build the trace for a seed (same seed, same trace).
    pub generate: fn(u64) -> Trace,
}

/// Every built-in workload, in report order.
pub const WORKLOADS: [Workload; 15] = [
    Workload {
        name: "train-varlen",
        description: "transformer training steps whose sequence length changes from step to step",
        generate: train_varlen::generate,
    },
    Workload {
        name: "llm-serving",
        description: "LLM serving: concurrent requests whose contiguous KV caches grow per token and end at random",
        generate: llm_serving::generate,
    },
    Workload {
        name: "model-switch",
        description: "loading and unloading models of different shapes on one device, serving between switches",
        generate: model_switch::generate,
    },
    Workload {
        name: "mixed-vision-language",
        description: "image generation and language jobs interleaved on one device, on three streams",
        generate: mixed_vision_language::generate,
    },
    Workload {
        name: "llm-serving-growable",
        description: "llm-serving with each request's KV cache one growable buffer, grown 32 tokens at a time",
        generate: llm_serving_growable::generate,
    },
    Workload {
        name: "llm-serving-growable-switch",
        description: "three models switched by sleep and wake, serving with growable KV caches between switches",
        generate: llm_serving_growable::generate_switch,
    },
    Workload {
        name: "offload-pipeline-4",
        description: "13B inference, 24 layers streamed in on 3 copy streams (prefetch depth 4), used and freed on the compute stream",
        generate: offload_pipeline::generate_4,
    },
    Workload {
        name: "offload-pipeline-10",
        description: "offload-pipeline-4 with 9 copy streams (10 streams)",
        generate: offload_pipeline::generate_10,
    },
    Workload {
        name: "offload-pipeline-32",
        description: "offload-pipeline-4 with 31 copy streams (32 streams)",
        generate: offload_pipeline::generate_32,
    },
    Workload {
        name: "many-streams-4",
        description: "4 streams that keep to themselves: each prefetches, uses and frees its own layers, activations and small buffers, no record_stream",
        generate: many_streams::generate_4,
    },
    Workload {
        name: "many-streams-10",
        description: "many-streams-4 on 10 streams",
        generate: many_streams::generate_10,
    },
    Workload {
        name: "many-streams-32",
        description: "many-streams-4 on 32 streams",
        generate: many_streams::generate_32,
    },
    Workload {
        name: "many-streams-handoff-4",
        description: "many-streams-4 with one cross-stream hand-off per stream and pass (record_stream, freed by its maker)",
        generate: many_streams::generate_handoff_4,
    },
    Workload {
        name: "many-streams-handoff-10",
        description: "many-streams-handoff-4 on 10 streams",
        generate: many_streams::generate_handoff_10,
    },
    Workload {
        name: "many-streams-handoff-32",
        description: "many-streams-handoff-4 on 32 streams",
        generate: many_streams::generate_handoff_32,
    },
];

/// The workload called `name`, if there is one.
pub fn find(name: &str) -> Option<&'static Workload> {
    WORKLOADS.iter().find(|w| w.name == name)
}

/// The seed used when none is given.
pub const DEFAULT_SEED: u64 = 42;

/// Bytes of a bf16 / fp16 element.
pub(crate) const BF16: u64 = 2;
/// Bytes of an fp32 element.
pub(crate) const FP32: u64 = 4;
/// Bytes of an int64 element.
pub(crate) const I64: u64 = 8;

/// The seeded generator every workload draws from: PCG-64 (MCG variant), seeded
/// from the user's seed and a per-workload salt so that two workloads with one
/// seed do not share a stream of numbers.
pub(crate) fn rng_for(seed: u64, salt: u64) -> Pcg64Mcg {
    Pcg64Mcg::seed_from_u64(seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A draw from a log-normal distribution with the given median and shape
/// `sigma`, clamped to `[lo, hi]`. (Box-Muller on two uniform draws.)
pub(crate) fn lognormal(rng: &mut Pcg64Mcg, median: f64, sigma: f64, lo: u64, hi: u64) -> u64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    let x = median * (sigma * z).exp();
    (x.round() as u64).clamp(lo, hi)
}

/// Round `x` up to a multiple of `unit` (> 0).
pub(crate) fn round_up_to(x: u64, unit: u64) -> u64 {
    x.div_ceil(unit) * unit
}

/// Builds a trace event by event, handing out ids and keeping the live set, so
/// that a generator cannot emit a free of an id that is not live.
///
/// Invariant: every emitted `Free` names an id emitted by an earlier `Alloc` and
/// not freed since; ids are `0, 1, 2, ...` in allocation order.
#[derive(Debug)]
pub(crate) struct TraceBuilder {
    events: Vec<Event>,
    live: HashMap<u64, u64>,
    /// Live growable buffers: (length, maximum).
    growables: HashMap<u64, (u64, u64)>,
    next_id: u64,
    preexisting: usize,
}

impl TraceBuilder {
    /// An empty trace.
    pub(crate) fn new() -> Self {
        TraceBuilder {
            events: Vec::new(),
            live: HashMap::new(),
            growables: HashMap::new(),
            next_id: 0,
            preexisting: 0,
        }
    }

    /// Emit an allocation of `size` bytes (at least 1) on `stream`; returns its id.
    pub(crate) fn alloc(&mut self, size: u64, stream: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let size = size.max(1);
        self.events.push(Event::Alloc { id, size, stream });
        self.live.insert(id, size);
        id
    }

    /// Emit the free of `id` if it is live (a stale id emits nothing).
    pub(crate) fn free(&mut self, id: u64) {
        if self.live.remove(&id).is_some() {
            self.events.push(Event::Free { id });
        }
    }

    /// Free every id in `ids`, in order.
    pub(crate) fn free_all(&mut self, ids: &[u64]) {
        for &id in ids {
            self.free(id);
        }
    }

    /// Emit a use of the live allocation `id` on `stream` (`record_stream`;
    /// a stale id emits nothing).
    pub(crate) fn record_stream(&mut self, id: u64, stream: u64) {
        if self.live.contains_key(&id) {
            self.events.push(Event::RecordStream { id, stream });
        }
    }

    /// Emit an allocation of `size` bytes (at least 1) on `stream` carrying
    /// `tag`; returns its id (freed with [`TraceBuilder::free`]).
    pub(crate) fn alloc_tagged(&mut self, size: u64, stream: u64, tag: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let size = size.max(1);
        self.events.push(Event::AllocTagged {
            id,
            size,
            stream,
            tag,
        });
        self.live.insert(id, size);
        id
    }

    /// Emit the creation of a growable buffer of at most `max` bytes (at
    /// least 1) on `stream`; returns its id.
    pub(crate) fn create_growable(&mut self, max: u64, stream: u64) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let max = max.max(1);
        self.events.push(Event::CreateGrowable { id, max, stream });
        self.growables.insert(id, (0, max));
        id
    }

    /// Emit the growth of buffer `id` to `bytes`, clamped to its maximum (a
    /// stale id, or a length it has already reached, emits nothing).
    pub(crate) fn grow(&mut self, id: u64, bytes: u64) {
        if let Some((len, max)) = self.growables.get_mut(&id) {
            let bytes = bytes.min(*max);
            if bytes > *len {
                *len = bytes;
                self.events.push(Event::Grow { id, bytes });
            }
        }
    }

    /// Emit the release of buffer `id` if it is live.
    pub(crate) fn release(&mut self, id: u64) {
        if self.growables.remove(&id).is_some() {
            self.events.push(Event::ReleaseGrowable { id });
        }
    }

    /// Emit a sleep of `tag`.
    pub(crate) fn sleep(&mut self, tag: u64) {
        self.events.push(Event::Sleep { tag });
    }

    /// Emit a wake of `tag`.
    pub(crate) fn wake(&mut self, tag: u64) {
        self.events.push(Event::Wake { tag });
    }

    /// Mark everything emitted so far as the pre-existing prefix.
    pub(crate) fn end_preexisting(&mut self) {
        self.preexisting = self.events.len();
    }

    /// The finished trace.
    pub(crate) fn finish(self, name: &str) -> Trace {
        Trace {
            name: name.to_string(),
            events: self.events,
            preexisting: self.preexisting,
        }
    }
}

/// A transformer's shape, for weight lists and activation sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Transformer {
    /// Layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// Width of the key and value projections (== hidden without grouped-query attention).
    pub kv_dim: u64,
    /// MLP width.
    pub ffn: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Attention heads.
    pub heads: u64,
    /// Gated MLP (gate, up, down) rather than (fc1, fc2).
    pub gated: bool,
}

impl Transformer {
    /// Llama-2-7B.
    pub(crate) const LLAMA_7B: Transformer = Transformer {
        layers: 32,
        hidden: 4096,
        kv_dim: 4096,
        ffn: 11008,
        vocab: 32000,
        heads: 32,
        gated: true,
    };

    /// The parameter tensors (element counts) of one layer, in load order.
    pub(crate) fn layer_params(&self) -> Vec<u64> {
        let h = self.hidden;
        let mut p = vec![
            h,               // input norm
            h * h,           // q
            self.kv_dim * h, // k
            self.kv_dim * h, // v
            h * h,           // o
            h,               // post-attention norm
        ];
        if self.gated {
            p.extend([self.ffn * h, self.ffn * h, h * self.ffn]);
        } else {
            p.extend([self.ffn * h, self.ffn, h * self.ffn, h]);
        }
        p
    }

    /// Every parameter tensor (element counts) of the model, in load order:
    /// embedding, layers, final norm, output head.
    pub(crate) fn all_params(&self) -> Vec<u64> {
        let mut p = vec![self.vocab * self.hidden];
        let layer = self.layer_params();
        for _ in 0..self.layers {
            p.extend_from_slice(&layer);
        }
        p.push(self.hidden);
        p.push(self.vocab * self.hidden);
        p
    }

    /// Bytes of K (or V) cache per token, all layers, in bf16.
    pub(crate) fn kv_bytes_per_token(&self) -> u64 {
        self.layers * self.kv_dim * BF16
    }
}

/// The batch-wide activations of one decode step of `n` sequences on
/// `stream`: hidden state, MLP intermediate, fp32 logits (both serving
/// workloads).
pub(crate) fn decode_step(b: &mut TraceBuilder, m: &Transformer, n: u64, stream: u64) {
    let hidden = b.alloc(n * m.hidden * BF16, stream);
    let mlp = b.alloc(n * m.ffn * 2 * BF16, stream);
    b.free(mlp);
    let logits = b.alloc(n * m.vocab * FP32, stream);
    b.free(hidden);
    b.free(logits);
}

/// The activations of one prefill pass over a `prompt`-token request on
/// `stream`: token ids, hidden state, one representative layer, the fp32
/// logits of its last token (both serving workloads).
pub(crate) fn prefill_step(b: &mut TraceBuilder, m: &Transformer, prompt: u64, stream: u64) {
    let ids = b.alloc(prompt * I64, stream);
    let hidden = b.alloc(prompt * m.hidden * BF16, stream);
    inference_layer(b, m, prompt, prompt, stream);
    let logits = b.alloc(m.vocab * FP32, stream);
    b.free(hidden);
    b.free(ids);
    b.free(logits);
}

/// The activations of one representative transformer layer over `tokens`
/// tokens in bf16, allocated and freed as an inference forward pass does
/// (hidden state, fused QKV, attention scores over `context` keys, MLP
/// intermediates). The other layers repeat the same sizes in the same order:
/// they would add events, not different fragmentation.
pub(crate) fn inference_layer(
    b: &mut TraceBuilder,
    m: &Transformer,
    tokens: u64,
    context: u64,
    stream: u64,
) {
    let h = m.hidden;
    let normed = b.alloc(tokens * h * BF16, stream);
    let qkv = b.alloc(tokens * (h + 2 * m.kv_dim) * BF16, stream);
    let scores = b.alloc(m.heads * tokens * context * BF16, stream);
    let ctx = b.alloc(tokens * h * BF16, stream);
    b.free(scores);
    b.free(qkv);
    let up = b.alloc(tokens * m.ffn * BF16 * if m.gated { 2 } else { 1 }, stream);
    let act = b.alloc(tokens * m.ffn * BF16, stream);
    b.free(up);
    let out = b.alloc(tokens * h * BF16, stream);
    b.free(act);
    b.free(normed);
    b.free(ctx);
    b.free(out);
}

/// Channel widths of the four resolution levels of a Stable-Diffusion-1.5-style UNet.
pub(crate) const UNET_CHANNELS: [u64; 4] = [320, 640, 1280, 1280];

/// The parameter tensors (element counts) of a Stable-Diffusion-1.5-style UNet
/// (about 0.86 B parameters), in load order: per level two ResNet blocks and
/// (on the first three levels) a cross-attention transformer, mirrored on the
/// way up with three blocks per level.
pub(crate) fn unet_params() -> Vec<u64> {
    let mut p = vec![4 * 320 * 9, 320];
    let resnet = |p: &mut Vec<u64>, c_in: u64, c: u64| {
        p.extend([c_in, c_in, c_in * c * 9, c, 1280 * c, c, c, c, c * c * 9, c]);
        if c_in != c {
            p.extend([c_in * c, c]);
        }
    };
    let attention = |p: &mut Vec<u64>, c: u64| {
        p.extend([c, c, c * c, c]); // norm, proj_in
        p.extend([c, c, c * c, c * c, c * c, c * c, c]); // self-attention
        p.extend([c, c, c * c, 768 * c, 768 * c, c * c, c]); // cross-attention
        p.extend([c, c, c * 8 * c, 8 * c, 4 * c * c, c]); // GEGLU feed-forward
        p.extend([c * c, c]); // proj_out
    };
    let mut c_prev = 320;
    for (level, &c) in UNET_CHANNELS.iter().enumerate() {
        for block in 0..2 {
            resnet(&mut p, if block == 0 { c_prev } else { c }, c);
            if level < 3 {
                attention(&mut p, c);
            }
        }
        if level < 3 {
            p.extend([c * c * 9, c]); // downsample
        }
        c_prev = c;
    }
    resnet(&mut p, 1280, 1280);
    attention(&mut p, 1280);
    resnet(&mut p, 1280, 1280);
    for (level, &c) in UNET_CHANNELS.iter().enumerate().rev() {
        for _ in 0..3 {
            resnet(&mut p, c + c_prev, c);
            if level < 3 {
                attention(&mut p, c);
            }
            c_prev = c;
        }
        if level > 0 {
            p.extend([c * c * 9, c]); // upsample
        }
    }
    p.extend([320, 320, 320 * 4 * 9, 4]);
    p
}

/// One UNet denoising step over `batch` latents of an image `resolution`
/// pixels square, in bf16 (classifier-free guidance doubles the batch): skip
/// activations kept from the way down to the way up, a convolution temporary
/// per level, and attention scores (8 heads x tokens²) on the levels whose
/// token count is at most 4096 (larger ones use memory-efficient attention).
pub(crate) fn unet_denoise_step(b: &mut TraceBuilder, batch: u64, resolution: u64, stream: u64) {
    let batch = 2 * batch;
    let latent = resolution / 8;
    let mut skips = Vec::new();
    for (level, &c) in UNET_CHANNELS.iter().enumerate() {
        let side = (latent >> level).max(1);
        let tokens = side * side;
        let act = batch * c * tokens * BF16;
        let tmp = b.alloc(act, stream);
        if level < 3 && tokens <= 4096 {
            let scores = b.alloc(batch * 8 * tokens * tokens * BF16, stream);
            b.free(scores);
        }
        skips.push(b.alloc(act, stream));
        b.free(tmp);
    }
    for (level, &c) in UNET_CHANNELS.iter().enumerate().rev() {
        let side = (latent >> level).max(1);
        let act = batch * c * side * side * BF16;
        let cat = b.alloc(2 * act, stream);
        if let Some(skip) = skips.pop() {
            b.free(skip);
        }
        let out = b.alloc(act, stream);
        b.free(cat);
        b.free(out);
    }
}
