//! Checks of the `f16`/`bf16` tensor-core kernels, shared by the GPU tests and the emulated
//! tests: inputs drawn in `f32`, rounded to the 16-bit type and uploaded; the float64 CPU
//! reference runs on the rounded values widened back (exactly) to `f32`, so the error measured
//! is the kernels' own: 16-bit rounding of P, dS and the outputs, and `f32` accumulation.

use attn_host::check::{Tolerance, l2_norm, lse_error, random_normal, relative_l2_error, relative_l2_error_above};
use attn_host::dtype::{from_f32_slice, to_f32_vec};
use attn_host::{
    AttentionOptions, AttentionOutput, AttentionShape, Context, DType, DeviceTensor, DqAccumulation, Element,
    Gradients, TileConfig, cpu,
};
use rand::rngs::StdRng;

pub use super::attention::Extras;
use rand::{RngExt, SeedableRng};

/// Relative L2 error allowed on O, and on dQ, dK, dV, per type (issue 4's bar; the table lives in
/// `attn_host::check::Tolerance`).
pub fn tolerances(dtype: DType) -> (f64, f64) {
    let tolerance = Tolerance::of(dtype);
    (tolerance.o, tolerance.grad)
}

/// Relative error allowed on the logsumexp (computed in `f32` from exact products; the same in
/// both 16-bit types).
pub const LSE_TOLERANCE: f64 = Tolerance::F16.lse;

/// How the inputs are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Inputs {
    /// Standard normal Q, K, V, dO.
    Normal,
    /// Q and K uniform in [−8, 8] (with scale 1 the logits reach the hundreds: a stress test of
    /// the online softmax), V and dO standard normal.
    LargeLogits,
}

/// One problem's inputs: the 16-bit values widened to `f32` (for the reference) and on the device.
pub struct Problem16<T: Element> {
    pub shape: AttentionShape,
    pub host: [Vec<f32>; 4],
    pub device: [DeviceTensor<T>; 4],
}

impl<T: Element> Problem16<T> {
    pub fn new(ctx: &Context, shape: AttentionShape, seed: u64, inputs: Inputs) -> Self {
        let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
        let host: [Vec<f32>; 4] = std::array::from_fn(|i| {
            let n = shapes[i].iter().product();
            let drawn = if inputs == Inputs::LargeLogits && i < 2 {
                let mut rng = StdRng::seed_from_u64(seed + i as u64);
                (0..n).map(|_| rng.random_range(-8.0f32..=8.0)).collect()
            } else {
                random_normal(n, seed + i as u64)
            };
            to_f32_vec(&from_f32_slice::<T>(&drawn))
        });
        let device = std::array::from_fn(|i| ctx.upload(&from_f32_slice::<T>(&host[i]), &shapes[i]).unwrap());
        Self { shape, host, device }
    }

    pub fn forward(&self, ctx: &Context, tile: TileConfig, options: &AttentionOptions) -> AttentionOutput<T> {
        let nan = T::from_f32(f32::NAN);
        let mut out = AttentionOutput {
            o: ctx.full(&self.shape.q_shape(), nan).unwrap(),
            lse: ctx.full(&self.shape.lse_shape(), f32::NAN).unwrap(),
        };
        let [q, k, v, _] = &self.device;
        let tile = super::on_device(ctx, tile, T::DTYPE, self.shape.head_dim, None);
        ctx.flash_attention_forward_into(q, k, v, &mut out, options, tile)
            .unwrap_or_else(|e| panic!("{} forward {tile}: {e}", T::DTYPE));
        out
    }

    pub fn backward(
        &self,
        ctx: &Context,
        tile: TileConfig,
        mode: DqAccumulation,
        options: &AttentionOptions,
        fwd: &AttentionOutput<T>,
    ) -> Gradients<T> {
        let nan = T::from_f32(f32::NAN);
        let mut grads = Gradients {
            dq: ctx.full(&self.shape.q_shape(), nan).unwrap(),
            dk: ctx.full(&self.shape.kv_shape(), nan).unwrap(),
            dv: ctx.full(&self.shape.kv_shape(), nan).unwrap(),
            d_sinks: options.sinks.map(|_| ctx.full(&[self.shape.num_heads_q], f32::NAN).unwrap()),
            d_bias: options.bias.map(|b| ctx.full(b.shape(), f32::NAN).unwrap()),
        };
        let [q, k, v, d_o] = &self.device;
        let tile = super::on_device(ctx, tile, T::DTYPE, self.shape.head_dim, Some(mode));
        ctx.flash_attention_backward_into(q, k, v, &fwd.o, &fwd.lse, d_o, &mut grads, options, tile, mode)
            .unwrap_or_else(|e| panic!("{} backward {tile} {mode:?}: {e}", T::DTYPE));
        grads
    }
}

/// Runs the forward pass at `tile` and, with `backward`, the backward pass at its tile and dQ
/// mode, on fresh inputs of `shape`; checks O, LSE, dQ, dK and dV against the float64 reference.
/// Every output is poisoned with NaN first, so an unwritten element fails. Returns whether it
/// ran: not for a type or head_dim the device has no kernels for (`super::runs`, `super::fits`).
pub fn check16<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    tile: TileConfig,
    backward: Option<(TileConfig, DqAccumulation)>,
    options: AttentionOptions,
    seed: u64,
    inputs: Inputs,
) -> bool {
    check16_with_sinks::<T>(ctx, shape, tile, backward, options, None, seed, inputs)
}

/// [`check16`] with attention sinks `sinks` (one per query head, uploaded here and added to
/// `options`); the backward's dSinks is checked too.
#[allow(clippy::too_many_arguments)]
pub fn check16_with_sinks<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    tile: TileConfig,
    backward: Option<(TileConfig, DqAccumulation)>,
    options: AttentionOptions,
    sinks: Option<&[f32]>,
    seed: u64,
    inputs: Inputs,
) -> bool {
    check16_with_extras::<T>(ctx, shape, tile, backward, options, Extras { sinks, bias: None }, seed, inputs)
}

/// [`check16`] with [`Extras`]: sinks and a bias, their gradients checked too.
#[allow(clippy::too_many_arguments)]
pub fn check16_with_extras<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    tile: TileConfig,
    backward: Option<(TileConfig, DqAccumulation)>,
    options: AttentionOptions,
    extras: Extras,
    seed: u64,
    inputs: Inputs,
) -> bool {
    let dtype = T::DTYPE;
    let fits = |dq| super::fits(ctx, dtype, shape.head_dim, dq);
    if !super::runs(ctx, dtype) || !fits(None) || backward.is_some_and(|(_, mode)| !fits(Some(mode))) {
        return false;
    }
    let (o_tolerance, grad_tolerance) = tolerances(dtype);
    let problem = Problem16::<T>::new(ctx, shape, seed, inputs);
    let [q, k, v, d_o] = &problem.host;
    let uploaded = extras.upload(ctx);
    let (options, params) = extras.bind(options, &uploaded, shape.head_dim);
    let fwd = problem.forward(ctx, tile, &options);
    let reference = cpu::attention(q, k, v, &shape, params).unwrap();
    let o = to_f32_vec(&fwd.o.to_host().unwrap());
    let lse = fwd.lse.to_host().unwrap();
    let (err_o, err_lse) = (relative_l2_error(&o, &reference.o), lse_error(&lse, &reference.lse));
    let what = format!("{dtype} {tile} {options:?} {inputs:?} on {shape:?}");
    assert!(
        err_o <= o_tolerance && err_lse <= LSE_TOLERANCE,
        "{what}: relative L2 error O {err_o:.3e} (≤ {o_tolerance:.0e}), LSE {err_lse:.3e}"
    );
    let Some((bwd_tile, mode)) = backward else { return true };
    let grads = problem.backward(ctx, bwd_tile, mode, &options, &fwd);
    // The exact gradient of the O the backward was handed (checked above; D from it, as the
    // kernels compute it): `cpu::attention_backward_given_o`. Against the exact O's gradient, a
    // row whose softmax is nearly one-hot gets a D that differs by O's rounding, which there is
    // all of dS (errors of 2–100 %, the same as a plain implementation at 16 bits makes).
    let reference = cpu::attention_backward_given_o(q, k, v, &o, d_o, &shape, params).unwrap();
    // Each gradient is judged relative to its own norm, but never to less than a thousandth of
    // dV's (an absolute floor, as numpy's `atol`): where every row's softmax is one-hot to `f32`
    // (the other keys' P below 2⁻²⁴), dS = P ∘ (dP − D) cancels in the reference too, dQ and dK
    // are ~1e-11 there, and any `f32` computation of them is noise of ~1e-5 around that (relative
    // errors of 1e5). dV = Pᵀ dO never cancels, so its norm is the problem's own scale.
    let floor = 1e-3 * l2_norm(&reference.dv);
    for (name, got, want) in
        [("dQ", &grads.dq, &reference.dq), ("dK", &grads.dk, &reference.dk), ("dV", &grads.dv, &reference.dv)]
    {
        let got = to_f32_vec(&got.to_host().unwrap());
        assert_eq!(got.len(), want.len(), "{what}: {name} has the wrong length");
        let err = relative_l2_error_above(&got, want, floor);
        assert!(
            err <= grad_tolerance,
            "{what}, backward {bwd_tile} {mode:?}: {name} relative L2 error {err:.3e} (≤ {grad_tolerance:.0e})"
        );
    }
    let to_host = |t: &Option<DeviceTensor<f32>>| t.as_ref().map(|t| t.to_host().unwrap());
    extras.check_gradients(to_host(&grads.d_sinks), to_host(&grads.d_bias), &reference, |name, err| {
        assert!(err <= grad_tolerance, "{what}, backward {bwd_tile} {mode:?}: {name} relative L2 error {err:.3e}")
    });
    true
}
