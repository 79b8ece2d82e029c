//! `llm-serving`: continuous-batching inference of Llama-2-7B in bf16 with a
//! contiguous KV cache per request that grows as tokens are generated.
//!
//! - Live throughout: the model's 291 weight tensors, 13.5 GB in bf16.
//! - 130 requests; prompt lengths log-normal (median 600 tokens, sigma 0.9,
//!   16..=3500), output lengths log-normal (median 200, sigma 1.0, 8..=2048):
//!   a request ends when its drawn output length is reached (EOS at random).
//! - Each running request holds a K and a V cache, each `layers x capacity x
//!   hidden` in bf16 (256 KiB per token each). Capacity starts at the prompt
//!   rounded up to 256 tokens and grows by 256 tokens when full: a new, larger
//!   tensor is allocated, the cache copied, the old one freed (64 MiB steps), as
//!   a server with contiguous caches does.
//! - The scheduler admits up to 2 new requests per step while the batch is
//!   under 64 requests and the KV caches under 30 GiB. A prefill runs one
//!   representative layer's activations over the prompt (attention scores are
//!   heads x prompt²); a decode step allocates the batch's hidden state, MLP
//!   intermediate and fp32 logits, then frees them.

use super::{
    decode_step, lognormal, prefill_step, rng_for, round_up_to, TraceBuilder, Transformer, BF16,
};
use crate::trace::Trace;

const REQUESTS: usize = 130;
const MAX_BATCH: usize = 64;
const ADMIT_PER_STEP: usize = 2;
const KV_BUDGET: u64 = 30 << 30;
const BLOCK_TOKENS: u64 = 256;

struct Request {
    k: u64,
    v: u64,
    capacity: u64,
    len: u64,
    left: u64,
}

/// Generate the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = rng_for(seed, 2);
    let m = Transformer::LLAMA_7B;
    let mut b = TraceBuilder::new();
    let s0 = 0;
    for n in m.all_params() {
        b.alloc(n * BF16, s0);
    }
    b.end_preexisting();

    let per_token = m.kv_bytes_per_token();
    let mut running: Vec<Request> = Vec::new();
    let mut issued = 0;
    let mut pending: Option<(u64, u64)> = None;
    let mut kv_bytes = 0u64;
    while issued < REQUESTS || !running.is_empty() {
        // Admission and prefill.
        let mut admitted = 0;
        while admitted < ADMIT_PER_STEP && running.len() < MAX_BATCH && issued < REQUESTS {
            let (prompt, output) = match pending.take() {
                Some(p) => p,
                None => (
                    lognormal(&mut rng, 600.0, 0.9, 16, 3500),
                    lognormal(&mut rng, 200.0, 1.0, 8, 2048),
                ),
            };
            let capacity = round_up_to(prompt + 1, BLOCK_TOKENS);
            let need = 2 * capacity * per_token;
            if !running.is_empty() && kv_bytes + need > KV_BUDGET {
                pending = Some((prompt, output));
                break;
            }
            let k = b.alloc(capacity * per_token, s0);
            let v = b.alloc(capacity * per_token, s0);
            kv_bytes += need;
            prefill_step(&mut b, &m, prompt, s0);
            running.push(Request {
                k,
                v,
                capacity,
                len: prompt,
                left: output,
            });
            issued += 1;
            admitted += 1;
        }

        // One decode step for the whole batch.
        let n = running.len() as u64;
        if n == 0 {
            continue;
        }
        decode_step(&mut b, &m, n, s0);
        let mut i = 0;
        while i < running.len() {
            let r = &mut running[i];
            r.len += 1;
            r.left = r.left.saturating_sub(1);
            if r.left == 0 {
                kv_bytes = kv_bytes.saturating_sub(2 * r.capacity * per_token);
                let (k, v) = (r.k, r.v);
                b.free(k);
                b.free(v);
                running.swap_remove(i);
                continue;
            }
            if r.len >= r.capacity {
                let grown = r.capacity + BLOCK_TOKENS;
                let new_k = b.alloc(grown * per_token, s0);
                b.free(r.k);
                let new_v = b.alloc(grown * per_token, s0);
                b.free(r.v);
                kv_bytes += 2 * BLOCK_TOKENS * per_token;
                r.k = new_k;
                r.v = new_v;
                r.capacity = grown;
            }
            i += 1;
        }
    }
    b.finish("llm-serving")
}
