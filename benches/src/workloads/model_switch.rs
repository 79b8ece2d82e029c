//! `model-switch`: a home inference server that loads and unloads models of
//! different shapes on one device and serves requests between switches.
//!
//! - Seven models, bf16 weights loaded tensor by tensor: Llama-2-7B (13.5 GB),
//!   Llama-2-13B (26.0 GB), Mistral-7B (14.5 GB, grouped-query attention),
//!   Phi-2 (5.6 GB), Qwen-1.8B (3.7 GB, 152k vocabulary), Whisper-large
//!   (3.2 GB as 64 layers of hidden 1280) and a Stable-Diffusion-1.5 UNet
//!   (1.7 GB). Phi-2 and Whisper come as fp32 checkpoints: each tensor is read
//!   into an fp32 temporary and cast to a bf16 tensor.
//! - 28 phases; each picks a model by popularity (30, 10, 20, 12, 10, 8, 10 %),
//!   loads it if it is not resident (first unloading the least recently used
//!   models, tensor by tensor, until the resident weights fit 40 GiB), then
//!   serves 1 to 5 requests.
//! - A language request allocates a static KV cache for prompt + output
//!   (prompt log-normal median 500, output median 150), runs one representative
//!   prefill layer and 6 decode steps, then frees its cache. An image request
//!   runs 4 UNet denoising steps at 512, 768 or 1024 pixels, batch 1 to 4.

use super::{
    inference_layer, lognormal, rng_for, unet_denoise_step, unet_params, TraceBuilder, Transformer,
    BF16, FP32,
};
use crate::trace::Trace;
use rand::RngExt;

const PHASES: usize = 28;
const RESIDENT_BUDGET: u64 = 40 << 30;

#[derive(Clone, Copy)]
enum Kind {
    Language(Transformer),
    Unet,
}

struct Model {
    kind: Kind,
    fp32_checkpoint: bool,
    popularity: u32,
}

fn models() -> [Model; 7] {
    let t = |layers, hidden, kv_dim, ffn, vocab, heads, gated| Transformer {
        layers,
        hidden,
        kv_dim,
        ffn,
        vocab,
        heads,
        gated,
    };
    [
        Model {
            kind: Kind::Language(Transformer::LLAMA_7B),
            fp32_checkpoint: false,
            popularity: 30,
        },
        Model {
            kind: Kind::Language(t(40, 5120, 5120, 13824, 32000, 40, true)),
            fp32_checkpoint: false,
            popularity: 10,
        },
        Model {
            kind: Kind::Language(t(32, 4096, 1024, 14336, 32000, 32, true)),
            fp32_checkpoint: false,
            popularity: 20,
        },
        Model {
            kind: Kind::Language(t(32, 2560, 2560, 10240, 51200, 32, false)),
            fp32_checkpoint: true,
            popularity: 12,
        },
        Model {
            kind: Kind::Language(t(24, 2048, 2048, 5504, 151936, 16, true)),
            fp32_checkpoint: false,
            popularity: 10,
        },
        Model {
            kind: Kind::Language(t(64, 1280, 1280, 5120, 51866, 20, false)),
            fp32_checkpoint: true,
            popularity: 8,
        },
        Model {
            kind: Kind::Unet,
            fp32_checkpoint: false,
            popularity: 10,
        },
    ]
}

fn params(kind: &Kind) -> Vec<u64> {
    match kind {
        Kind::Language(m) => m.all_params(),
        Kind::Unet => unet_params(),
    }
}

/// Generate the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = rng_for(seed, 3);
    let models = models();
    let total_pop: u32 = models.iter().map(|m| m.popularity).sum();
    let mut b = TraceBuilder::new();
    let s0 = 0;
    // Resident models: (index, weight ids, bytes), least recently used first.
    let mut resident: Vec<(usize, Vec<u64>, u64)> = Vec::new();
    for _ in 0..PHASES {
        let mut pick = rng.random_range(0..total_pop);
        let mut which = 0;
        for (i, m) in models.iter().enumerate() {
            if pick < m.popularity {
                which = i;
                break;
            }
            pick -= m.popularity;
        }
        let model = &models[which];
        if let Some(pos) = resident.iter().position(|r| r.0 == which) {
            let entry = resident.remove(pos);
            resident.push(entry);
        } else {
            let weights = params(&model.kind);
            let bytes: u64 = weights.iter().map(|n| n * BF16).sum();
            while !resident.is_empty()
                && resident.iter().map(|r| r.2).sum::<u64>() + bytes > RESIDENT_BUDGET
            {
                let (_, ids, _) = resident.remove(0);
                b.free_all(&ids);
            }
            let mut ids = Vec::with_capacity(weights.len());
            for n in weights {
                if model.fp32_checkpoint {
                    let staging = b.alloc(n * FP32, s0);
                    ids.push(b.alloc(n * BF16, s0));
                    b.free(staging);
                } else {
                    ids.push(b.alloc(n * BF16, s0));
                }
            }
            resident.push((which, ids, bytes));
        }

        let requests = rng.random_range(1..=5);
        for _ in 0..requests {
            match model.kind {
                Kind::Language(m) => {
                    let prompt = lognormal(&mut rng, 500.0, 0.9, 16, 3000);
                    let output = lognormal(&mut rng, 150.0, 0.8, 8, 1024);
                    let context = prompt + output;
                    let k = b.alloc(context * m.kv_bytes_per_token(), s0);
                    let v = b.alloc(context * m.kv_bytes_per_token(), s0);
                    let hidden = b.alloc(prompt * m.hidden * BF16, s0);
                    inference_layer(&mut b, &m, prompt, prompt, s0);
                    b.free(hidden);
                    for _ in 0..6 {
                        let h = b.alloc(m.hidden * BF16, s0);
                        let logits = b.alloc(m.vocab * FP32, s0);
                        b.free(h);
                        b.free(logits);
                    }
                    b.free(k);
                    b.free(v);
                }
                Kind::Unet => {
                    let resolution: u64 = [512, 768, 1024][rng.random_range(0..3)];
                    let batch = rng.random_range(1..=4);
                    let text = b.alloc(2 * batch * 77 * 768 * BF16, s0);
                    let latents = b.alloc(batch * 4 * (resolution / 8).pow(2) * FP32, s0);
                    for _ in 0..4 {
                        unet_denoise_step(&mut b, batch, resolution, s0);
                    }
                    let image = b.alloc(batch * 3 * resolution * resolution * FP32, s0);
                    b.free(latents);
                    b.free(text);
                    b.free(image);
                }
            }
        }
    }
    b.finish("model-switch")
}
