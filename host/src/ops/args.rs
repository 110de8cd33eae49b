//! **Ops layer.** Kernel arguments and launch shapes shared by the operations: the problem as
//! the kernels take it ([`ProblemArgs`]), one-dimensional grid-stride launches and the
//! FlashAttention grids.

use std::borrow::Cow;

use cudarc::driver::LaunchConfig;

use crate::problem::{AttentionOptions, AttentionShape, Bias, MaskTableRef, Sinks};
use crate::runtime::{Context, DeviceTensor, KernelArg, NullPointer};

/// Blocks for a grid-stride loop over `work` items at `per_block` items per block: enough to
/// cover the work, but no more than 32 blocks per SM (beyond that extra blocks only queue).
pub(super) fn grid_stride_blocks(ctx: &Context, work: usize, per_block: usize) -> u32 {
    let wanted = work.div_ceil(per_block).max(1);
    wanted.min(ctx.device().sm_count * 32) as u32
}

pub(super) fn one_dim(blocks: u32, threads: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes: 0 }
}

/// The problem as kernel arguments, in the kernels' order: the shape's six integers, then (with a
/// mask) the mask flag, the diagonal's offset and the window's left edge
/// ([`AttentionOptions::mask_args`]), the mask table's address ([`crate::MaskTableRef`], or
/// null), the score modification's cap and ALiBi `max_bias`
/// ([`crate::ScoreMod`]), the attention sinks' address ([`crate::Sinks`], or null), and the
/// additive bias ([`crate::Bias`]): its address, its gradient's (a backward's
/// [`ProblemArgs::with_bias_grad`]) and its batch and head strides.
pub(super) struct ProblemArgs<'a> {
    shape: [usize; 6],
    causal: usize,
    causal_offset: isize,
    window_offset: isize,
    mask_table: Option<MaskTableRef<'a>>,
    softcap: f32,
    alibi_max_bias: f32,
    sinks: Option<Sinks<'a>>,
    bias: Option<Bias<'a>>,
    bias_grad: Option<&'a DeviceTensor<f32>>,
    bias_strides: (usize, usize),
}

/// The sinks, bias and bias-gradient arguments of a problem without them.
const NO_F32: NullPointer = NullPointer("f32");

/// The mask-table argument of a problem without one.
const NO_MASK_TABLE: NullPointer = NullPointer("i32");

impl<'a> ProblemArgs<'a> {
    pub(super) fn new(shape: &AttentionShape, options: &AttentionOptions<'a>) -> Self {
        let (causal, causal_offset, window_offset) = options.mask_args(shape);
        let (softcap, alibi_max_bias) = options.score.kernel_args();
        let s = shape;
        Self {
            shape: [s.batch, s.num_heads_q, s.num_heads_kv, s.seqlen_q, s.seqlen_k, s.head_dim],
            causal,
            causal_offset,
            window_offset,
            mask_table: options.mask_table,
            softcap,
            alibi_max_bias,
            sinks: options.sinks,
            bias: options.bias,
            bias_grad: None,
            bias_strides: options.bias.map_or((0, 0), |b| b.strides()),
        }
    }

    /// These arguments with dBias (`grads.d_bias`), which the backward's K/V-outer kernels add
    /// dS into; `None` (the default): a null pointer.
    pub(super) fn with_bias_grad<'b>(self, grad: Option<&'b DeviceTensor<f32>>) -> ProblemArgs<'b>
    where
        'a: 'b,
    {
        let args: ProblemArgs<'b> = self;
        ProblemArgs { bias_grad: grad, ..args }
    }

    /// The entry to launch for the sm_80-path flash kernel `entry`: its `_table` twin when the
    /// problem has a band table, else `entry` itself. Every kernel of the sm_80 modules' flash
    /// families has both; the plain one never reads the table (`attention_kernel!` in
    /// `kernels/src/lib.rs` says why they are two).
    pub(super) fn entry(&self, entry: &'static str) -> Cow<'static, str> {
        crate::kernels::entry_for_table(entry, self.mask_table.is_some())
    }

    /// `head`, the six shape integers, then `tail`.
    pub(super) fn with_shape<'b>(
        &'b self,
        head: &[&'b dyn KernelArg],
        tail: &[&'b dyn KernelArg],
    ) -> Vec<&'b dyn KernelArg> {
        let mut args = head.to_vec();
        args.extend(self.shape.iter().map(|a| a as &dyn KernelArg));
        args.extend_from_slice(tail);
        args
    }

    /// `head`, the shape, the mask flag, offsets and table, the score modification, the sinks
    /// and the bias, then `tail`.
    pub(super) fn with_mask<'b>(
        &'b self,
        head: &[&'b dyn KernelArg],
        tail: &[&'b dyn KernelArg],
    ) -> Vec<&'b dyn KernelArg> {
        let sinks: &dyn KernelArg = match &self.sinks {
            Some(sinks) => sinks,
            None => &NO_F32,
        };
        let mask_table: &dyn KernelArg = match &self.mask_table {
            Some(table) => table,
            None => &NO_MASK_TABLE,
        };
        let bias: &dyn KernelArg = match &self.bias {
            Some(bias) => bias,
            None => &NO_F32,
        };
        let bias_grad: &dyn KernelArg = match self.bias_grad {
            Some(grad) => grad,
            None => &NO_F32,
        };
        let mut args = self.with_shape(
            head,
            &[
                &self.causal,
                &self.causal_offset,
                &self.window_offset,
                mask_table,
                &self.softcap,
                &self.alibi_max_bias,
                sinks,
                bias,
                bias_grad,
                &self.bias_strides.0,
                &self.bias_strides.1,
            ],
        );
        args.extend_from_slice(tail);
        args
    }
}

/// A FlashAttention launch: a `(x, y, z)` grid of `threads`-thread blocks with `smem` bytes of
/// dynamic shared memory.
pub(super) fn flash_config((x, y, z): (usize, usize, usize), threads: usize, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}
