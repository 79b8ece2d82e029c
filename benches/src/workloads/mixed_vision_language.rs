//! `mixed-vision-language`: image generation and chat interleaved on one device,
//! on three streams, as a shared workstation GPU runs them.
//!
//! - Live throughout: Llama-2-7B in bf16 (13.5 GB, stream 0), a
//!   Stable-Diffusion-1.5 UNet (1.7 GB, stream 1) and a CLIP-L text encoder
//!   (12 layers, hidden 768, 0.25 GB, stream 2).
//! - 300 ticks. Stream 0 (chat): up to 12 concurrent conversations, each with a
//!   static KV cache for its prompt plus its reply (prompt log-normal median 800
//!   tokens, reply median 200) allocated when it starts and freed when it ends;
//!   a new one starts with probability 0.3 per tick; each tick is one decode
//!   burst of the batch (hidden state and fp32 logits) and a conversation ends
//!   after its reply's bursts of 16 tokens.
//! - Stream 1 (images): one generation job at a time, 512, 768 or 1024 pixels
//!   square, batch 1 to 4, 12 UNet denoising steps, one per tick.
//! - Stream 2 (pre/post-processing): the text encoding of a job's prompts when
//!   it starts, and the VAE decode (128-channel activations at full
//!   resolution, then the fp32 image) when it ends.

use super::{
    inference_layer, lognormal, rng_for, unet_denoise_step, unet_params, TraceBuilder, Transformer,
    BF16, FP32,
};
use crate::trace::Trace;
use rand::RngExt;

const TICKS: usize = 300;
const MAX_CHATS: usize = 12;
const TOKENS_PER_TICK: u64 = 16;
const DENOISE_STEPS: u32 = 12;
const CHAT: u64 = 0;
const IMAGE: u64 = 1;
const PREP: u64 = 2;

struct Chat {
    k: u64,
    v: u64,
    bursts_left: u64,
}

struct ImageJob {
    batch: u64,
    resolution: u64,
    steps_left: u32,
    text: u64,
    latents: u64,
}

/// CLIP-L's text encoder.
const CLIP_TEXT: Transformer = Transformer {
    layers: 12,
    hidden: 768,
    kv_dim: 768,
    ffn: 3072,
    vocab: 49408,
    heads: 12,
    gated: false,
};

/// Generate the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = rng_for(seed, 4);
    let llm = Transformer::LLAMA_7B;
    let mut b = TraceBuilder::new();
    for n in llm.all_params() {
        b.alloc(n * BF16, CHAT);
    }
    for n in unet_params() {
        b.alloc(n * BF16, IMAGE);
    }
    for n in CLIP_TEXT.all_params() {
        b.alloc(n * BF16, PREP);
    }
    b.end_preexisting();

    let mut chats: Vec<Chat> = Vec::new();
    let mut image: Option<ImageJob> = None;
    for _ in 0..TICKS {
        // Chat: maybe start a conversation (prefill), then one decode burst.
        if chats.len() < MAX_CHATS && rng.random_bool(0.3) {
            let prompt = lognormal(&mut rng, 800.0, 0.8, 32, 3500);
            let reply = lognormal(&mut rng, 200.0, 0.9, 16, 1500);
            let bytes = (prompt + reply) * llm.kv_bytes_per_token();
            let k = b.alloc(bytes, CHAT);
            let v = b.alloc(bytes, CHAT);
            let hidden = b.alloc(prompt * llm.hidden * BF16, CHAT);
            inference_layer(&mut b, &llm, prompt, prompt, CHAT);
            b.free(hidden);
            chats.push(Chat {
                k,
                v,
                bursts_left: reply.div_ceil(TOKENS_PER_TICK),
            });
        }
        if !chats.is_empty() {
            let n = chats.len() as u64;
            let hidden = b.alloc(n * llm.hidden * BF16, CHAT);
            let logits = b.alloc(n * llm.vocab * FP32, CHAT);
            b.free(hidden);
            b.free(logits);
            let mut i = 0;
            while i < chats.len() {
                chats[i].bursts_left = chats[i].bursts_left.saturating_sub(1);
                if chats[i].bursts_left == 0 {
                    let done = chats.swap_remove(i);
                    b.free(done.k);
                    b.free(done.v);
                } else {
                    i += 1;
                }
            }
        }

        // Images: start a job (text encoding on the preprocessing stream) or run a step.
        let job = match image.take() {
            Some(job) => job,
            None => {
                let batch = rng.random_range(1..=4);
                let resolution: u64 = [512, 768, 1024][rng.random_range(0..3)];
                let tokens = 2 * batch * 77;
                let ids = b.alloc(tokens * 8, PREP);
                inference_layer(&mut b, &CLIP_TEXT, tokens, 77, PREP);
                let text = b.alloc(tokens * 768 * BF16, PREP);
                b.free(ids);
                let latents = b.alloc(batch * 4 * (resolution / 8).pow(2) * FP32, IMAGE);
                ImageJob {
                    batch,
                    resolution,
                    steps_left: DENOISE_STEPS,
                    text,
                    latents,
                }
            }
        };
        unet_denoise_step(&mut b, job.batch, job.resolution, IMAGE);
        let job = ImageJob {
            steps_left: job.steps_left - 1,
            ..job
        };
        if job.steps_left == 0 {
            // VAE decode on the preprocessing stream.
            let pixels = job.batch * job.resolution * job.resolution;
            let act = b.alloc(pixels * 128 * BF16, PREP);
            let act2 = b.alloc(pixels * 128 * BF16, PREP);
            b.free(act);
            let out = b.alloc(pixels * 3 * FP32, PREP);
            b.free(act2);
            b.free(job.latents);
            b.free(job.text);
            b.free(out);
        } else {
            image = Some(job);
        }
    }
    b.finish("mixed-vision-language")
}
