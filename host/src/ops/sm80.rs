//! **Ops layer.** FlashAttention on the sm_80 kernels of a tile, on either kernel path: the
//! CUDA-core `f32` kernels (levels 3 and 4) and the `mma.sync` tensor-core kernels for `f16` and
//! `bf16` (levels 5 and 6). [`Context::flash_attention_forward`] and
//! [`Context::flash_attention_backward`] (`ops/mod.rs`) dispatch here unless a Hopper kernel
//! replaces them; the tile sweep ([`crate::tune`]) calls these directly.

use super::args::{ProblemArgs, flash_config};
use super::{AttentionOutput, Gradients};
use crate::dtype::{DType, Element};
use crate::error::Result;
use crate::kernels::{FlashKernel, backward_kernels};
use crate::problem::{AttentionOptions, AttentionShape, DqAccumulation, TileConfig, check_flash_grid};
use crate::runtime::{Context, DeviceTensor, KernelArg};

impl Context {
    // ANCHOR: flash_forward_launch
    /// [`Context::flash_attention_forward_into`] on the sm_80 kernel of `tile`, whatever the
    /// kernel path: what the tile sweep measures. `shape` is what
    /// [`Context::check_attention`] returned for these tensors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn flash_attention_forward_sm80_into<T: Element>(
        &self,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<()> {
        let shape = *shape;
        let kernel = FlashKernel::Forward;
        let entry = tile.validate_kernel(kernel, T::DTYPE, shape.head_dim, self.device())?;
        check_flash_grid(&shape)?;
        // The forward kernel only ever exponentiates, so it takes the scale with log₂e folded in
        // (it uses exp2); the backward kernels also need the plain scale for dQ and dK, and fold
        // log₂e in themselves.
        let scale_log2 = options.checked_scale(shape.head_dim)? * std::f32::consts::LOG2_E;
        let config = flash_config(
            (shape.seqlen_q.div_ceil(tile.block_m), shape.num_heads_q, shape.batch),
            tile.threads_for(kernel, T::DTYPE, shape.head_dim),
            tile.shared_memory_bytes_for(kernel, T::DTYPE, shape.head_dim),
        );
        let args = ProblemArgs::new(&shape, options);
        let head: [&dyn KernelArg; 5] = [q, k, v, &out.o, &out.lse];
        self.launch(&args.entry(entry), config, &args.with_mask(&head, &[&scale_log2]))
    }
    // ANCHOR_END: flash_forward_launch

    /// The sm_80 kernels of `tile` and `dq`, on either kernel path: what
    /// [`Context::flash_attention_backward_into`] runs when no Hopper kernel replaces them, and
    /// what the tile sweep measures. `shape` is what [`Context::check_backward`] returned for
    /// these tensors.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn flash_attention_backward_sm80_into<T: Element>(
        &self,
        shape: &AttentionShape,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<()> {
        let shape = *shape;
        let dtype = T::DTYPE;
        let entries: Vec<&'static str> = backward_kernels(dq)
            .iter()
            .map(|&kernel| tile.validate_kernel(kernel, dtype, shape.head_dim, self.device()))
            .collect::<Result<_>>()?;
        check_flash_grid(&shape)?;
        let delta = self.row_deltas(o, d_o, &shape)?;
        self.sink_gradient(&shape, lse, &delta, options, grads)?;
        let scale = options.checked_scale(shape.head_dim)?;
        // dBias: the K/V-outer kernel adds dS into it (`BiasPlane`), from zero.
        if let Some(d_bias) = &mut grads.d_bias {
            self.fill_zeros(d_bias)?;
        }
        let args = ProblemArgs::new(&shape, options).with_bias_grad(grads.d_bias.as_ref());
        let entries: Vec<_> = entries.into_iter().map(|entry| args.entry(entry)).collect();
        let d = shape.head_dim;
        let config = |kernel: FlashKernel| {
            let blocks = match kernel {
                FlashKernel::Backward | FlashKernel::BackwardDkDv => {
                    (shape.seqlen_k.div_ceil(tile.block_n), shape.num_heads_kv, shape.batch)
                }
                FlashKernel::Forward | FlashKernel::BackwardDq => {
                    (shape.seqlen_q.div_ceil(tile.block_m), shape.num_heads_q, shape.batch)
                }
            };
            flash_config(blocks, tile.threads_for(kernel, dtype, d), tile.shared_memory_bytes_for(kernel, dtype, d))
        };
        let [q_, k_, v_, do_, lse_, delta_]: [&dyn KernelArg; 6] = [q, k, v, d_o, lse, &delta];
        match (dtype, dq) {
            // The f32 kernels share one signature, dQ included.
            (DType::F32, DqAccumulation::Atomic) => {
                // The kernel adds into dQ: start from zero.
                self.fill_zeros(&mut grads.dq)?;
                let head: [&dyn KernelArg; 9] = [q_, k_, v_, do_, lse_, delta_, &grads.dq, &grads.dk, &grads.dv];
                self.launch(&entries[0], config(FlashKernel::Backward), &args.with_mask(&head, &[&scale]))
            }
            (DType::F32, DqAccumulation::Deterministic) => {
                let head: [&dyn KernelArg; 9] = [q_, k_, v_, do_, lse_, delta_, &grads.dq, &grads.dk, &grads.dv];
                let args = args.with_mask(&head, &[&scale]);
                self.launch(&entries[0], config(FlashKernel::BackwardDkDv), &args)?;
                self.launch(&entries[1], config(FlashKernel::BackwardDq), &args)
            }
            // The tensor-core kernels add dQ into an f32 accumulator, rounded to T at the end.
            (_, DqAccumulation::Atomic) => {
                let mut accum = self.alloc_output::<f32>(&shape.q_shape())?;
                self.fill_zeros(&mut accum)?;
                let head: [&dyn KernelArg; 9] = [q_, k_, v_, do_, lse_, delta_, &accum, &grads.dk, &grads.dv];
                self.launch(&entries[0], config(FlashKernel::Backward), &args.with_mask(&head, &[&scale]))?;
                self.round_to(&accum, &mut grads.dq)
            }
            (_, DqAccumulation::Deterministic) => {
                let head: [&dyn KernelArg; 8] = [q_, k_, v_, do_, lse_, delta_, &grads.dk, &grads.dv];
                self.launch(&entries[0], config(FlashKernel::BackwardDkDv), &args.with_mask(&head, &[&scale]))?;
                let head: [&dyn KernelArg; 7] = [q_, k_, v_, do_, lse_, delta_, &grads.dq];
                self.launch(&entries[1], config(FlashKernel::BackwardDq), &args.with_mask(&head, &[&scale]))
            }
        }
    }
}
