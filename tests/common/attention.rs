//! The attention checks shared by the GPU tests and the emulated tests: the same function runs on
//! either kind of [`Context`].

use attn_host::check::{Tolerance, gradient_error, lse_error, random_normal, relative_l2_error};
use attn_host::{
    AttentionOptions, AttentionOutput, AttentionShape, Context, DType, DeviceTensor, DqAccumulation, Gradients,
    TileConfig, cpu,
};

/// Tolerances of the f32 kernels: relative L2 error against the float64 reference (the table
/// lives in `attn_host::check::Tolerance`, which the main job and `attn --check` judge by too).
pub const O_TOLERANCE: f64 = Tolerance::F32.o;
pub const LSE_TOLERANCE: f64 = Tolerance::F32.lse;
pub const GRAD_TOLERANCE: f64 = Tolerance::F32.grad;

#[derive(Clone, Copy, Debug)]
pub enum Kernel {
    Naive,
    Flash(TileConfig, DqAccumulation),
}

/// Device copies of one problem's random inputs.
pub struct Problem {
    pub shape: AttentionShape,
    pub host: [Vec<f32>; 4], // q, k, v, dO
    pub q: DeviceTensor,
    pub k: DeviceTensor,
    pub v: DeviceTensor,
    pub d_o: DeviceTensor,
}

impl Problem {
    pub fn new(ctx: &Context, shape: AttentionShape, seed: u64) -> Self {
        let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape(), shape.q_shape()];
        let host: [Vec<f32>; 4] = std::array::from_fn(|i| random_normal(shapes[i].iter().product(), seed + i as u64));
        let upload = |i: usize| ctx.upload(&host[i], &shapes[i]).unwrap();
        let (q, k, v, d_o) = (upload(0), upload(1), upload(2), upload(3));
        Self { shape, host, q, k, v, d_o }
    }

    pub fn forward(&self, ctx: &Context, kernel: Kernel, options: &AttentionOptions) -> AttentionOutput {
        let mut out = AttentionOutput {
            o: ctx.full(&self.shape.q_shape(), f32::NAN).unwrap(),
            lse: ctx.full(&self.shape.lse_shape(), f32::NAN).unwrap(),
        };
        match kernel {
            Kernel::Naive => ctx.attention_naive_into(&self.q, &self.k, &self.v, &mut out, options),
            Kernel::Flash(tile, _) => {
                let tile = super::on_device(ctx, tile, DType::F32, self.shape.head_dim, None);
                ctx.flash_attention_forward_into(&self.q, &self.k, &self.v, &mut out, options, tile)
            }
        }
        .unwrap_or_else(|e| panic!("{kernel:?} forward: {e}"));
        out
    }

    pub fn backward(
        &self,
        ctx: &Context,
        kernel: Kernel,
        options: &AttentionOptions,
        fwd: &AttentionOutput,
    ) -> Gradients {
        let mut grads = Gradients {
            dq: ctx.full(&self.shape.q_shape(), f32::NAN).unwrap(),
            dk: ctx.full(&self.shape.kv_shape(), f32::NAN).unwrap(),
            dv: ctx.full(&self.shape.kv_shape(), f32::NAN).unwrap(),
            d_sinks: options.sinks.map(|_| ctx.full(&[self.shape.num_heads_q], f32::NAN).unwrap()),
            d_bias: options.bias.map(|b| ctx.full(b.shape(), f32::NAN).unwrap()),
        };
        let (q, k, v, d_o) = (&self.q, &self.k, &self.v, &self.d_o);
        match kernel {
            Kernel::Naive => ctx.attention_naive_backward_into(q, k, v, &fwd.o, d_o, &mut grads, options),
            Kernel::Flash(tile, mode) => {
                let tile = super::on_device(ctx, tile, DType::F32, self.shape.head_dim, Some(mode));
                ctx.flash_attention_backward_into(q, k, v, &fwd.o, &fwd.lse, d_o, &mut grads, options, tile, mode)
            }
        }
        .unwrap_or_else(|e| panic!("{kernel:?} backward: {e}"));
        grads
    }

    pub fn params<'a>(&self, options: &AttentionOptions<'a>) -> cpu::Params<'a> {
        cpu::Params::of(options, self.shape.head_dim)
    }
}

/// Runs `kernel` forward (and, with `backward`, backward) on fresh random inputs of `shape` and
/// checks every output against the CPU.
pub fn check(
    ctx: &Context,
    shape: AttentionShape,
    kernel: Kernel,
    options: AttentionOptions,
    seed: u64,
    backward: bool,
) {
    check_with_sinks(ctx, shape, kernel, options, None, seed, backward)
}

/// [`check`] with attention sinks `sinks` (one per query head, uploaded here and added to
/// `options`); the backward's dSinks is checked too.
pub fn check_with_sinks(
    ctx: &Context,
    shape: AttentionShape,
    kernel: Kernel,
    options: AttentionOptions,
    sinks: Option<&[f32]>,
    seed: u64,
    backward: bool,
) {
    check_with_extras(ctx, shape, kernel, options, Extras { sinks, bias: None }, seed, backward)
}

/// What a check adds to its options from host values: attention sinks (one per query head) and
/// an additive bias; each is uploaded by the check and its gradient checked in the backward.
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras<'a> {
    pub sinks: Option<&'a [f32]>,
    pub bias: Option<cpu::BiasValues<'a>>,
}

impl<'a> Extras<'a> {
    /// The device copies of the sinks and the bias.
    pub fn upload(&self, ctx: &Context) -> (Option<DeviceTensor>, Option<DeviceTensor>) {
        let sinks = self.sinks.map(|s| ctx.upload(s, &[s.len()]).unwrap());
        let bias = self.bias.map(|b| ctx.upload(b.values, &b.shape).unwrap());
        (sinks, bias)
    }

    /// `options` with the uploaded extras, and the CPU reference's parameters for them.
    pub fn bind<'b>(
        &self,
        options: AttentionOptions<'b>,
        (sinks, bias): &'b (Option<DeviceTensor>, Option<DeviceTensor>),
        head_dim: usize,
    ) -> (AttentionOptions<'b>, cpu::Params<'b>)
    where
        'a: 'b,
    {
        let options = match sinks {
            Some(t) => options.with_sinks(t),
            None => options,
        };
        let options = match bias {
            Some(t) => options.with_bias(t),
            None => options,
        };
        let params = cpu::Params { sinks: self.sinks, bias: self.bias, ..cpu::Params::of(&options, head_dim) };
        (options, params)
    }

    /// Checks dSinks and dBias of `grads` (host copies: `d_sinks`, `d_bias`) against the
    /// reference's with `judge` (the relative L2 error a tier allows, or panics).
    pub fn check_gradients(
        &self,
        d_sinks: Option<Vec<f32>>,
        d_bias: Option<Vec<f32>>,
        reference: &cpu::GradientReference,
        judge: impl Fn(&str, f64),
    ) {
        if self.sinks.is_some() {
            judge("dSinks", gradient_error(&d_sinks.expect("dSinks"), &reference.d_sinks));
        }
        if self.bias.is_some() {
            judge("dBias", gradient_error(&d_bias.expect("dBias"), &reference.d_bias));
        }
    }
}

/// [`check`] with [`Extras`]: sinks and a bias.
pub fn check_with_extras(
    ctx: &Context,
    shape: AttentionShape,
    kernel: Kernel,
    options: AttentionOptions,
    extras: Extras,
    seed: u64,
    backward: bool,
) {
    if let Kernel::Flash(_, mode) = kernel {
        let fits = |dq| super::fits(ctx, DType::F32, shape.head_dim, dq);
        if !fits(None) || (backward && !fits(Some(mode))) {
            return;
        }
    }
    let problem = Problem::new(ctx, shape, seed);
    let [q, k, v, d_o] = &problem.host;
    let uploaded = extras.upload(ctx);
    let (options, params) = extras.bind(options, &uploaded, shape.head_dim);
    let fwd = problem.forward(ctx, kernel, &options);
    let reference = cpu::attention(q, k, v, &shape, params).unwrap();
    let (o, lse) = (fwd.o.to_host().unwrap(), fwd.lse.to_host().unwrap());
    let (err_o, err_lse) = (relative_l2_error(&o, &reference.o), lse_error(&lse, &reference.lse));
    assert!(
        err_o <= O_TOLERANCE && err_lse <= LSE_TOLERANCE,
        "{kernel:?} {options:?} on {shape:?}: relative L2 error O {err_o:.3e}, LSE {err_lse:.3e}"
    );
    if !backward {
        return;
    }
    let grads = problem.backward(ctx, kernel, &options, &fwd);
    let reference = cpu::attention_backward(q, k, v, d_o, &shape, params).unwrap();
    for (name, got, want) in
        [("dQ", &grads.dq, &reference.dq), ("dK", &grads.dk, &reference.dk), ("dV", &grads.dv, &reference.dv)]
    {
        // An exactly zero reference (one visible key) is judged by the RMS of the result.
        let err = gradient_error(&got.to_host().unwrap(), want);
        assert!(err <= GRAD_TOLERANCE, "{kernel:?} {options:?} on {shape:?}: {name} relative L2 error {err:.3e}");
    }
    let to_host = |t: &Option<DeviceTensor>| t.as_ref().map(|t| t.to_host().unwrap());
    extras.check_gradients(to_host(&grads.d_sinks), to_host(&grads.d_bias), &reference, |name, err| {
        assert!(err <= GRAD_TOLERANCE, "{kernel:?} {options:?} on {shape:?}: {name} relative L2 error {err:.3e}")
    });
}

/// Poisons one element of Q, K or V at a time (NaN or ∞) and checks, under a top-left causal
/// mask, that exactly the rows whose reference is non-finite are non-finite, and every other row
/// is untouched.
pub fn poisoned_rows(ctx: &Context, kernel: Kernel, shape: AttentionShape) {
    let d = shape.head_dim;
    let last = shape.seqlen_k - 1;
    let poisons: [(usize, usize, f32); 5] = [
        (0, 5.min(last), f32::NAN),
        // +∞ in a Q row: some of its scores are +∞, and its LSE must be +∞ (not NaN).
        (0, 7.min(shape.seqlen_q - 1), f32::INFINITY),
        (1, 40.min(last), f32::NAN),
        (2, 50.min(last), f32::INFINITY),
        (2, last, f32::NAN),
    ];
    for (index, row, value) in poisons {
        let mut problem = Problem::new(ctx, shape, 300);
        problem.host[index][row * d + 3] = value;
        let device = match index {
            0 => &mut problem.q,
            1 => &mut problem.k,
            _ => &mut problem.v,
        };
        device.copy_from_host(&problem.host[index]).unwrap();
        let options = AttentionOptions::causal(attn_host::Causal::TopLeft);
        let out = problem.forward(ctx, kernel, &options);
        let [q, k, v, _] = &problem.host;
        let reference = cpu::attention(q, k, v, &shape, problem.params(&options)).unwrap();
        let tensor = ["q", "k", "v"][index];
        compare_rows(&out, &reference, d, &format!("{kernel:?}, {value} in {tensor} row {row}"));
    }
}

/// Row by row: finite reference rows match within 1e-5 (relative L2), non-finite ones are not
/// finite in the result either, and an infinite reference LSE (+∞ for a row with a +∞ score) is
/// the same infinity.
pub fn compare_rows(out: &AttentionOutput, reference: &cpu::Reference, d: usize, what: &str) {
    let (o, lse) = (out.o.to_host().unwrap(), out.lse.to_host().unwrap());
    let mut affected = 0;
    for row in 0..lse.len() {
        let (got, want) = (&o[row * d..(row + 1) * d], &reference.o[row * d..(row + 1) * d]);
        let reference_finite = want.iter().all(|x| x.is_finite()) && reference.lse[row].is_finite();
        if reference_finite {
            let err = relative_l2_error(got, want);
            assert!(err <= 1e-5, "{what}: row {row} should be untouched, error {err:.2e}");
        } else {
            affected += 1;
            let finite = got.iter().all(|x| x.is_finite()) && lse[row].is_finite();
            assert!(!finite, "{what}: row {row} should be affected but is finite");
            if reference.lse[row].is_infinite() {
                assert_eq!(lse[row] as f64, reference.lse[row], "{what}: row {row}'s LSE");
            }
        }
    }
    assert!(affected > 0, "{what}: the poison should reach some rows");
}
