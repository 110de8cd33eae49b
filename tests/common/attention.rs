//! The attention checks shared by the GPU tests and the emulated tests: the same function runs on
//! either kind of [`Context`].

use attn_host::check::{lse_error, random_normal, relative_l2_error};
use attn_host::{
    AttentionOptions, AttentionOutput, AttentionShape, Context, DeviceTensor, DqAccumulation, Gradients, TileConfig,
    cpu,
};

/// Tolerances of the f32 kernels: relative L2 error against the float64 reference.
pub const O_TOLERANCE: f64 = 1e-5;
pub const LSE_TOLERANCE: f64 = 1e-5;
pub const GRAD_TOLERANCE: f64 = 1e-4;

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
        };
        let (q, k, v, d_o) = (&self.q, &self.k, &self.v, &self.d_o);
        match kernel {
            Kernel::Naive => ctx.attention_naive_backward_into(q, k, v, &fwd.o, d_o, &mut grads, options),
            Kernel::Flash(tile, mode) => {
                ctx.flash_attention_backward_into(q, k, v, &fwd.o, &fwd.lse, d_o, &mut grads, options, tile, mode)
            }
        }
        .unwrap_or_else(|e| panic!("{kernel:?} backward: {e}"));
        grads
    }

    pub fn params(&self, options: &AttentionOptions) -> cpu::Params {
        cpu::Params { scale: options.scale_for(self.shape.head_dim) as f64, causal: options.causal }
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
    let problem = Problem::new(ctx, shape, seed);
    let [q, k, v, d_o] = &problem.host;
    let fwd = problem.forward(ctx, kernel, &options);
    let reference = cpu::attention(q, k, v, &shape, problem.params(&options)).unwrap();
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
    let reference = cpu::attention_backward(q, k, v, d_o, &shape, problem.params(&options)).unwrap();
    for (name, got, want) in
        [("dQ", &grads.dq, &reference.dq), ("dK", &grads.dk, &reference.dk), ("dV", &grads.dv, &reference.dv)]
    {
        let err = relative_l2_error(&got.to_host().unwrap(), want);
        assert!(err <= GRAD_TOLERANCE, "{kernel:?} {options:?} on {shape:?}: {name} relative L2 error {err:.3e}");
    }
}
