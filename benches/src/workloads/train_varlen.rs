//! `train-varlen`: mixed-precision AdamW training of a 1B-parameter GPT-style
//! transformer whose sequence length changes from step to step.
//!
//! - Model: 12 layers, hidden 2560, 20 heads, MLP 10240 (fc1/fc2 with biases),
//!   vocabulary 32000: 1.03 B parameters.
//! - Live throughout (the pre-existing prefix): fp32 master weights and AdamW's
//!   two moments per parameter, 12.3 GB together.
//! - A step packs a token budget of 8192 tokens into `batch = 8192 / seq`
//!   sequences; `seq` is log-normal (median 768, sigma 0.75) clamped to
//!   128..=4096 and padded to a multiple of 128, as a length-bucketed loader
//!   does. Activations are sized by tokens x hidden, attention scores and
//!   probabilities by batch x heads x seq² (eager attention keeps the
//!   probabilities for backward), the loss by tokens x vocabulary.
//! - Autocast's bf16 weight copies live from a layer's forward to its backward;
//!   fp32 gradients are created during backward and freed at `zero_grad`
//!   (`set_to_none`); the foreach AdamW step holds one temporary per parameter.

use super::{lognormal, rng_for, round_up_to, TraceBuilder, BF16, FP32, I64};
use crate::trace::Trace;

const LAYERS: u64 = 12;
const HIDDEN: u64 = 2560;
const HEADS: u64 = 20;
const FFN: u64 = 4 * HIDDEN;
const VOCAB: u64 = 32000;
const TOKENS_PER_STEP: u64 = 8192;
const STEPS: usize = 8;

/// Parameter tensors (element counts) of one layer, in registration order.
fn layer_params() -> [u64; 12] {
    let h = HIDDEN;
    [
        h,         // ln1 weight
        h,         // ln1 bias
        3 * h * h, // qkv weight
        3 * h,     // qkv bias
        h * h,     // out-proj weight
        h,         // out-proj bias
        h,         // ln2 weight
        h,         // ln2 bias
        FFN * h,   // fc1 weight
        FFN,       // fc1 bias
        h * FFN,   // fc2 weight
        h,         // fc2 bias
    ]
}

/// Every parameter tensor (element counts): embedding, layers, final norm, head.
fn all_params() -> Vec<u64> {
    let mut p = vec![VOCAB * HIDDEN];
    for _ in 0..LAYERS {
        p.extend_from_slice(&layer_params());
    }
    p.extend([HIDDEN, HIDDEN, VOCAB * HIDDEN]);
    p
}

/// The sequence length of one step.
fn draw_seq(rng: &mut rand_pcg::Pcg64Mcg) -> u64 {
    round_up_to(lognormal(rng, 768.0, 0.75, 128, 4096), 128)
}

/// Generate the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = rng_for(seed, 1);
    let mut b = TraceBuilder::new();
    let params = all_params();
    let h = HIDDEN;
    let s0 = 0; // one stream

    // Live throughout: fp32 weights, then AdamW's exp_avg and exp_avg_sq per parameter.
    for &n in &params {
        b.alloc(n * FP32, s0);
    }
    for &n in &params {
        b.alloc(n * FP32, s0);
        b.alloc(n * FP32, s0);
    }
    b.end_preexisting();

    for _ in 0..STEPS {
        let seq = draw_seq(&mut rng);
        let batch = (TOKENS_PER_STEP / seq).max(1);
        let t = batch * seq;
        let scores_bytes = batch * HEADS * seq * seq * BF16;

        // Forward.
        let ids = b.alloc(t * I64, s0);
        let labels = b.alloc(t * I64, s0);
        let emb = b.alloc(t * h * BF16, s0);
        let mut saved: Vec<Vec<u64>> = Vec::new();
        for _ in 0..LAYERS {
            let casts = [
                b.alloc(3 * h * h * BF16, s0),
                b.alloc(h * h * BF16, s0),
                b.alloc(FFN * h * BF16, s0),
                b.alloc(h * FFN * BF16, s0),
            ];
            let ln1 = b.alloc(t * h * BF16, s0);
            let ln1_stats = b.alloc(2 * t * FP32, s0);
            let qkv = b.alloc(t * 3 * h * BF16, s0);
            let scores = b.alloc(scores_bytes, s0);
            let probs = b.alloc(scores_bytes, s0);
            b.free(scores);
            let ctx = b.alloc(t * h * BF16, s0);
            let attn_out = b.alloc(t * h * BF16, s0);
            let x1 = b.alloc(t * h * BF16, s0);
            b.free(attn_out);
            let ln2 = b.alloc(t * h * BF16, s0);
            let ln2_stats = b.alloc(2 * t * FP32, s0);
            let fc1 = b.alloc(t * FFN * BF16, s0);
            let gelu = b.alloc(t * FFN * BF16, s0);
            let fc2 = b.alloc(t * h * BF16, s0);
            let x2 = b.alloc(t * h * BF16, s0);
            b.free(fc2);
            let mut layer = casts.to_vec();
            layer.extend([
                ln1, ln1_stats, qkv, probs, ctx, x1, ln2, ln2_stats, fc1, gelu, x2,
            ]);
            saved.push(layer);
        }
        let lnf = b.alloc(t * h * BF16, s0);
        let logits = b.alloc(t * VOCAB * BF16, s0);
        let logits32 = b.alloc(t * VOCAB * FP32, s0);
        let logp = b.alloc(t * VOCAB * FP32, s0);
        b.free(logits32);
        let loss = b.alloc(FP32, s0);

        // Backward: the loss, the head, then layers in reverse.
        let mut grads: Vec<u64> = Vec::new();
        let grad_logp = b.alloc(t * VOCAB * FP32, s0);
        let grad_logits = b.alloc(t * VOCAB * BF16, s0);
        b.free(grad_logp);
        b.free(logp);
        let head_tmp = b.alloc(VOCAB * h * BF16, s0);
        grads.push(b.alloc(VOCAB * h * FP32, s0));
        b.free(head_tmp);
        let mut dx = b.alloc(t * h * BF16, s0);
        b.free(grad_logits);
        b.free(logits);
        for &n in &[HIDDEN, HIDDEN] {
            grads.push(b.alloc(n * FP32, s0));
        }
        b.free(lnf);
        while let Some(layer) = saved.pop() {
            // Parameter gradients: a bf16 result cast into a new fp32 gradient.
            for &n in layer_params().iter().rev() {
                let tmp = b.alloc(n * BF16, s0);
                grads.push(b.alloc(n * FP32, s0));
                b.free(tmp);
            }
            // Activation gradients, MLP then attention.
            let d_gelu = b.alloc(t * FFN * BF16, s0);
            let d_fc1 = b.alloc(t * FFN * BF16, s0);
            b.free(d_gelu);
            let d_ln2 = b.alloc(t * h * BF16, s0);
            b.free(d_fc1);
            let d_x1 = b.alloc(t * h * BF16, s0);
            b.free(d_ln2);
            b.free(dx);
            let d_ctx = b.alloc(t * h * BF16, s0);
            let d_probs = b.alloc(scores_bytes, s0);
            let d_scores = b.alloc(scores_bytes, s0);
            b.free(d_probs);
            let d_qkv = b.alloc(t * 3 * h * BF16, s0);
            b.free(d_scores);
            b.free(d_ctx);
            let d_ln1 = b.alloc(t * h * BF16, s0);
            b.free(d_qkv);
            dx = b.alloc(t * h * BF16, s0);
            b.free(d_ln1);
            b.free(d_x1);
            b.free_all(&layer);
        }
        grads.push(b.alloc(VOCAB * h * FP32, s0)); // embedding gradient
        b.free(dx);
        b.free(emb);
        b.free(ids);
        b.free(labels);
        b.free(loss);

        // Foreach AdamW: one temporary per parameter (the sqrt of exp_avg_sq), then freed.
        let temps: Vec<u64> = params.iter().map(|&n| b.alloc(n * FP32, s0)).collect();
        b.free_all(&temps);
        // zero_grad(set_to_none=True), in parameter order (the reverse of creation).
        grads.reverse();
        b.free_all(&grads);
    }
    b.finish("train-varlen")
}
