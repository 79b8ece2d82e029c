//! `llm-serving-growable` and `llm-serving-growable-switch`: LLM serving with
//! each request's KV cache a growable buffer (the serving events of
//! [`crate::trace`]) rather than a tensor reallocated as it fills.
//!
//! - `llm-serving-growable`: the requests, scheduler and activations of
//!   `llm-serving` (same draws for a seed), but each running request's K and
//!   V caches are one growable buffer created with the request's maximum
//!   (prompt + [`MAX_OUTPUT`] tokens), grown [`CHUNK_TOKENS`] tokens (two
//!   vLLM blocks, 16 MiB of K and V for Llama-2-7B) at a time as tokens are
//!   generated, and released when the request ends.
//! - `llm-serving-growable-switch`: three models (Llama-2-7B, Mistral-7B,
//!   Llama-2-13B) whose weights are allocated once, each under its own tag
//!   (0, 1, 2), the two not serving put to sleep. Each of [`PHASES`] phases
//!   picks a model by popularity; a switch puts the serving model to sleep
//!   and wakes the picked one (vLLM's sleep mode). A phase serves its
//!   requests to the end with growable KV caches, a decode step generating
//!   [`BURST_TOKENS`] tokens; the last phase switches back to Llama-2-7B.

use rand::RngExt;
use rand_pcg::Pcg64Mcg;

use super::{
    decode_step, lognormal, prefill_step, rng_for, round_up_to, TraceBuilder, Transformer, BF16,
};
use crate::trace::Trace;

/// Requests of `llm-serving-growable` (as `llm-serving`).
const REQUESTS: usize = 130;
/// The largest batch.
const MAX_BATCH: usize = 64;
/// Requests admitted per step at most.
const ADMIT_PER_STEP: usize = 2;
/// KV caches (their lengths) admitted up to this many bytes.
const KV_BUDGET: u64 = 30 << 30;
/// Tokens a KV cache grows by at a time: two vLLM blocks of 16 tokens
/// (16 MiB of K and V for Llama-2-7B, 8 pages).
pub const CHUNK_TOKENS: u64 = 32;
/// Tokens a decode step of the switch variant generates per request (a
/// decode burst, as in `mixed-vision-language`).
pub const BURST_TOKENS: u64 = 16;
/// The most tokens a request generates (its `max_tokens`): the upper bound
/// of the output length drawn, and what a request's buffers are created for.
pub const MAX_OUTPUT: u64 = 2048;
/// Phases of `llm-serving-growable-switch`.
pub const PHASES: usize = 14;

/// How requests are drawn and decoded.
#[derive(Clone, Copy)]
struct Shape {
    /// Output length: median, sigma, bounds.
    output: (f64, f64, u64, u64),
    /// Tokens a decode step generates per request.
    tokens_per_step: u64,
}

/// `llm-serving`'s requests, a token per decode step.
const SERVING: Shape = Shape {
    output: (200.0, 1.0, 8, MAX_OUTPUT),
    tokens_per_step: 1,
};

/// Shorter replies, [`BURST_TOKENS`] tokens per decode step (a phase drains
/// its requests: its length is its longest reply).
const SWITCH: Shape = Shape {
    output: (150.0, 0.8, 8, 1024),
    tokens_per_step: BURST_TOKENS,
};

struct Request {
    /// The request's KV cache: its K and V for every layer, one buffer.
    kv: u64,
    /// Tokens the buffers hold room for (their length).
    capacity: u64,
    len: u64,
    left: u64,
}

/// Serve `requests` requests with model `m` on stream `s` until every one
/// has ended, as `llm-serving`'s scheduler does.
fn serve(b: &mut TraceBuilder, rng: &mut Pcg64Mcg, m: &Transformer, requests: usize, shape: Shape) {
    let s0 = 0;
    let per_token = m.kv_bytes_per_token();
    let mut running: Vec<Request> = Vec::new();
    let mut issued = 0;
    let mut pending: Option<(u64, u64)> = None;
    let mut kv_bytes = 0u64;
    let (median, sigma, lo, hi) = shape.output;
    while issued < requests || !running.is_empty() {
        let mut admitted = 0;
        while admitted < ADMIT_PER_STEP && running.len() < MAX_BATCH && issued < requests {
            let (prompt, output) = match pending.take() {
                Some(p) => p,
                None => (
                    lognormal(rng, 600.0, 0.9, 16, 3500),
                    lognormal(rng, median, sigma, lo, hi),
                ),
            };
            let capacity = round_up_to(prompt + 1, CHUNK_TOKENS);
            let need = 2 * capacity * per_token;
            if !running.is_empty() && kv_bytes + need > KV_BUDGET {
                pending = Some((prompt, output));
                break;
            }
            let max = round_up_to(prompt + MAX_OUTPUT, CHUNK_TOKENS) * per_token;
            let kv = b.create_growable(2 * max, s0);
            b.grow(kv, 2 * capacity * per_token);
            kv_bytes += need;
            prefill_step(b, m, prompt, s0);
            running.push(Request {
                kv,
                capacity,
                len: prompt,
                left: output,
            });
            issued += 1;
            admitted += 1;
        }

        let n = running.len() as u64;
        if n == 0 {
            continue;
        }
        decode_step(b, m, n, s0);
        let mut i = 0;
        while i < running.len() {
            let r = &mut running[i];
            let step = shape.tokens_per_step.min(r.left);
            r.len += step;
            r.left -= step;
            if r.left == 0 {
                kv_bytes = kv_bytes.saturating_sub(2 * r.capacity * per_token);
                let kv = r.kv;
                b.release(kv);
                running.swap_remove(i);
                continue;
            }
            if r.len >= r.capacity {
                let grown = round_up_to(r.len + 1, CHUNK_TOKENS);
                kv_bytes += 2 * (grown - r.capacity) * per_token;
                r.capacity = grown;
                let (kv, bytes) = (r.kv, 2 * grown * per_token);
                b.grow(kv, bytes);
            }
            i += 1;
        }
    }
}

/// Generate `llm-serving-growable` for `seed`.
pub fn generate(seed: u64) -> Trace {
    // `llm-serving`'s salt: the same requests for a seed.
    let mut rng = rng_for(seed, 2);
    let m = Transformer::LLAMA_7B;
    let mut b = TraceBuilder::new();
    for n in m.all_params() {
        b.alloc(n * BF16, 0);
    }
    b.end_preexisting();
    serve(&mut b, &mut rng, &m, REQUESTS, SERVING);
    b.finish("llm-serving-growable")
}

/// The models of the switch variant, by tag, with their popularity (%).
fn models() -> [(Transformer, u32); 3] {
    let t = |layers, hidden, kv_dim, ffn| Transformer {
        layers,
        hidden,
        kv_dim,
        ffn,
        vocab: 32000,
        heads: hidden / 128,
        gated: true,
    };
    [
        (Transformer::LLAMA_7B, 50),
        (t(32, 4096, 1024, 14336), 30),
        (t(40, 5120, 5120, 13824), 20),
    ]
}

/// Generate `llm-serving-growable-switch` for `seed`.
pub fn generate_switch(seed: u64) -> Trace {
    let mut rng = rng_for(seed, 7);
    let models = models();
    let mut b = TraceBuilder::new();
    // Load every model once, the last loaded (tag 0) serving first.
    for tag in (0..models.len()).rev() {
        for n in models[tag].0.all_params() {
            b.alloc_tagged(n * BF16, 0, tag as u64);
        }
        if tag > 0 {
            b.sleep(tag as u64);
        }
    }
    b.end_preexisting();

    let total: u32 = models.iter().map(|m| m.1).sum();
    let mut serving = 0usize;
    let switch_to = |b: &mut TraceBuilder, to: usize, serving: &mut usize| {
        if to != *serving {
            b.sleep(*serving as u64);
            b.wake(to as u64);
            *serving = to;
        }
    };
    for _ in 0..PHASES {
        let mut pick = rng.random_range(0..total);
        let mut which = 0;
        for (i, m) in models.iter().enumerate() {
            if pick < m.1 {
                which = i;
                break;
            }
            pick -= m.1;
        }
        switch_to(&mut b, which, &mut serving);
        let requests = rng.random_range(6..=16);
        serve(&mut b, &mut rng, &models[which].0, requests, SWITCH);
    }
    switch_to(&mut b, 0, &mut serving);
    b.finish("llm-serving-growable-switch")
}
