//! **Ops layer**: the public attention API on a [`Context`] and its dispatch. Each call checks
//! its tensors, asks the selection policy ([`crate::select`]) which kernel runs and hands over to
//! the tier that launches it:
//!
//! | module | what |
//! |---|---|
//! | `mod.rs` | [`AttentionOutput`], [`Gradients`]; FlashAttention's entry points and dispatch; shared checks and helpers |
//! | `chunks` | problems with more heads or batch entries than one grid holds, run in chunks |
//! | `args` | the kernel arguments ([`ProblemArgs`](args::ProblemArgs)) and launch shapes |
//! | `naive` | vector add and standard attention (levels 1, 2) |
//! | `sm80` | FlashAttention on the sm_80 kernels: `f32` (levels 3, 4) and `mma.sync` (levels 5, 6) |
//! | `sm90` | FlashAttention on the Hopper kernels (levels 8, 9) |
//! | `decode` | attention over a KV cache: the split-KV decoder (level 10), its merge and append |
//! | `probes` | the Hopper probes of `wgmma` and TMA (level 7) |
//!
//! Nothing below this layer imports it.

mod args;
mod attention;
mod chunks;
mod decode;
mod naive;
mod probes;
mod sm80;
mod sm90;

pub use decode::{DecodeOptions, DecodePlan, KvCache, Layout};
pub use probes::DescriptorOffsets;

use std::borrow::Cow;

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::kernels::{FlashKernel, backward_kernels, entry};
use crate::layout::{ELEMENTWISE_THREADS, SOFTMAX_ROWS_PER_BLOCK, SOFTMAX_THREADS};
use crate::problem::{AttentionOptions, AttentionShape, Causal, DqAccumulation, MaskTableKind, TileConfig};
use crate::runtime::{Context, DeviceTensor};
use crate::select::{HopperForward, KernelPath};
use args::{grid_stride_blocks, one_dim};
pub use attention::Attention;

/// The outputs of an attention forward pass: O in the inputs' element type, LSE always `f32`.
#[derive(Debug)]
pub struct AttentionOutput<T: Element = f32> {
    /// O, `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub o: DeviceTensor<T>,
    /// Natural-log logsumexp of each score row, LSE = ln Σ_j exp(scale · q·k_j) over the keys
    /// the row sees (−∞ for a row that sees none), `[batch, num_heads_q, seqlen_q]`; what the
    /// backward pass needs to recompute P.
    pub lse: DeviceTensor,
}

/// The gradients of a loss with respect to the attention inputs, in the inputs' element type.
#[derive(Debug)]
pub struct Gradients<T: Element = f32> {
    /// ∂loss/∂Q, Q's shape `[batch, num_heads_q, seqlen_q, head_dim]`.
    pub dq: DeviceTensor<T>,
    /// ∂loss/∂K, K's shape `[batch, num_heads_kv, seqlen_k, head_dim]` (summed over the query heads
    /// of each group under grouped-query attention).
    pub dk: DeviceTensor<T>,
    /// ∂loss/∂V, V's shape.
    pub dv: DeviceTensor<T>,
    /// ∂loss/∂sinks, `f32` `[num_heads_q]`, when the problem has attention sinks
    /// ([`crate::Sinks`]; the backward passes allocate it then, and the `_into` calls need one
    /// there); `None` without.
    pub d_sinks: Option<DeviceTensor<f32>>,
    /// ∂loss/∂bias, `f32` of the bias's shape, when the problem has an additive bias
    /// ([`crate::Bias`]; the backward passes allocate it then, and the `_into` calls need one
    /// there); `None` without.
    pub d_bias: Option<DeviceTensor<f32>>,
}

impl Context {
    /// FlashAttention-2 forward pass (Dao 2023, Algorithm 1): O = softmax(Q Kᵀ · scale) V and the
    /// logsumexp, without materialising the score matrix. Shapes and masks as
    /// [`Context::attention_naive`]. `T` is `f32` (CUDA-core kernels) or [`half::f16`] /
    /// [`half::bf16`] (tensor-core kernels, `f32` accumulation, LSE in `f32`). head_dim is 1 to
    /// 256, each run on the smallest compiled head_dim at least as large
    /// ([`TileConfig::padded_head_dim`]), whose extra columns are zeros in shared memory, never
    /// read from or written to device memory; `tile` must be compiled for that head_dim and fit
    /// the device's shared memory ([`TileConfig::validate_kernel`]; defaults:
    /// [`TileConfig::default_for_dtype`]).
    ///
    /// On the sm_90a path ([`Context::kernel_path`]) a 16-bit forward pass of a head_dim that is a
    /// multiple of 8 up to 256 given the default tile runs the Hopper kernel instead
    /// ([`Context::flash_attention_forward_hopper`]); [`Context::forward_kernel_entry`] names the
    /// kernel a call runs.
    ///
    /// # Errors
    /// [`Error::Shape`], [`Error::HeadDimNotCompiled`], [`Error::TileNotCompiled`],
    /// [`Error::SharedMemory`], [`Error::Driver`].
    pub fn flash_attention_forward<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<AttentionOutput<T>> {
        let shape = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?;
        // Validate before allocating, so a bad tile costs no device memory.
        tile.validate_kernel(FlashKernel::Forward, T::DTYPE, shape.head_dim, self.device())?;
        let mut out = self.alloc_attention_output(&shape)?;
        self.flash_attention_forward_into(q, k, v, &mut out, options, tile)?;
        Ok(out)
    }

    /// [`Context::flash_attention_forward`] into existing output tensors.
    pub fn flash_attention_forward_into<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
        tile: TileConfig,
    ) -> Result<()> {
        self.require_dtype(T::DTYPE)?;
        let shape = self.check_attention(q, k, v, &out.o, &out.lse)?;
        self.check_sinks(&shape, options)?;
        if shape.is_empty() {
            return self.write_empty_forward(&shape, out, options);
        }
        if self.needs_chunks(&shape) {
            return self.forward_in_chunks(&shape, q, k, v, out, options, tile);
        }
        if let Some(kernel) = self.target().hopper_forward_for(T::DTYPE, &shape, tile, options) {
            return self.launch_hopper_forward(kernel, &shape, q, k, v, out, options);
        }
        self.flash_attention_forward_sm80_into(&shape, q, k, v, out, options, tile)
    }

    /// A short name of the kernel [`Context::flash_attention_forward`] runs for `dtype`, `shape`,
    /// `tile` and `options` on this context, for tables: the path and the configuration, e.g.
    /// `sm_90a m192_n128_s2` or `sm_80 m64_n64_s2`; on the CPU emulator, which runs the tile's
    /// kernel from its Rust source and no PTX, `emulated m64_n64_s2`; with ` on d96` after it when
    /// the head_dim runs on a larger compiled one. The options matter: a problem with a bias runs
    /// the sm_80 kernel on the sm_90a path too.
    pub fn forward_kernel_label(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        tile: TileConfig,
        options: &AttentionOptions,
    ) -> String {
        let on = |compiled: usize| compiled_suffix(shape.head_dim, compiled);
        let padded = TileConfig::padded_head_dim(FlashKernel::Forward, dtype, shape.head_dim).unwrap_or(shape.head_dim);
        if self.is_emulated() {
            return format!("emulated {tile}{}", on(padded));
        }
        match self.target().hopper_forward_for(dtype, shape, tile, options) {
            Some(kernel) => {
                let grid = HopperForward::grid(kernel, shape, options.causal, self.device().sm_count);
                let persistent = match (grid.persistent(), grid.dynamic) {
                    (true, true) => " persistent dynamic",
                    (true, false) => " persistent",
                    (false, _) => "",
                };
                format!("{} {}{persistent}{}", KernelPath::Sm90a, kernel.config_name(), on(kernel.head_dim))
            }
            None => format!("{} {tile}{}", self.portable_modules(), on(padded)),
        }
    }

    /// The kernel entry [`Context::flash_attention_forward`] launches for element type `dtype`,
    /// `shape`, `tile` and `options` on this context: a Hopper kernel (`hopper_flash_fwd_…`) or
    /// the sm_80 kernel of the tile, its `_table` twin when the options bind a band table
    /// ([`AttentionOptions::with_mask_table`]).
    ///
    /// # Errors
    /// As [`TileConfig::validate_kernel`].
    pub fn forward_kernel_entry(
        &self,
        dtype: DType,
        shape: &AttentionShape,
        tile: TileConfig,
        options: &AttentionOptions,
    ) -> Result<Cow<'static, str>> {
        match self.target().hopper_forward_for(dtype, shape, tile, options) {
            Some(kernel) => Ok(Cow::Borrowed(kernel.entry)),
            None => {
                let entry = tile.validate_kernel(FlashKernel::Forward, dtype, shape.head_dim, self.device())?;
                Ok(crate::kernels::entry_for_table(entry, options.mask_table.is_some()))
            }
        }
    }

    /// FlashAttention-2 backward pass (Dao 2023, Algorithm 2): dQ, dK, dV from Q, K, V, the
    /// forward's O and LSE, and dO = ∂loss/∂O, recomputing attention tiles on chip instead of
    /// reading a stored score matrix. Shapes: O and dO as Q, LSE `[batch, num_heads_q,
    /// seqlen_q]`; element type, masks, scale and head_dim as
    /// [`Context::flash_attention_forward`], which must have produced O and LSE with the same
    /// options. `dq` selects how dQ is summed ([`DqAccumulation`]); defaults for `tile`:
    /// [`TileConfig::default_backward_for_dtype`].
    ///
    /// Extra device memory, all O(seqlen): one `f32` per query row (D = rowsum(dO ∘ O)); with
    /// 16-bit types and atomic dQ, or on the Hopper kernel, also an `f32` copy of dQ to
    /// accumulate into.
    ///
    /// On the sm_90a path ([`Context::kernel_path`]) a 16-bit backward pass with the default tile
    /// and [`DqAccumulation::Atomic`] runs the Hopper kernel instead
    /// ([`Context::flash_attention_backward_hopper`]), and so does
    /// [`DqAccumulation::Deterministic`] unless `RUST_ATTENTION_HOPPER_DETERMINISTIC` is `0`;
    /// [`Context::dq_accumulation_for`] gives the mode that is fastest on this context.
    ///
    /// # Errors
    /// As [`Context::flash_attention_forward`]; the backward kernels need more shared memory per
    /// tile than the forward one.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        options: &AttentionOptions,
        tile: TileConfig,
        dq: DqAccumulation,
    ) -> Result<Gradients<T>> {
        let shape = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?;
        for &kernel in backward_kernels(dq) {
            tile.validate_kernel(kernel, T::DTYPE, shape.head_dim, self.device())?;
        }
        let mut grads = self.alloc_gradients(&shape, options)?;
        self.flash_attention_backward_into(q, k, v, o, lse, d_o, &mut grads, options, tile, dq)?;
        Ok(grads)
    }

    /// [`Context::flash_attention_backward`] into existing gradient tensors.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_attention_backward_into<T: Element>(
        &self,
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
        self.require_dtype(T::DTYPE)?;
        let shape = self.check_backward(q, k, v, o, lse, d_o, grads)?;
        self.check_backward_sinks(&shape, options, grads)?;
        if shape.is_empty() {
            return self.write_empty_backward(&shape, grads, options);
        }
        if self.needs_chunks(&shape) {
            return self.backward_in_chunks(&shape, (q, k, v), (o, lse, d_o), grads, options, tile, dq);
        }
        if let Some(kernel) = self.target().hopper_backward_for(T::DTYPE, shape.head_dim, tile, dq, options) {
            return self.launch_hopper_backward(kernel, &shape, q, k, v, o, lse, d_o, grads, options);
        }
        self.flash_attention_backward_sm80_into(&shape, q, k, v, o, lse, d_o, grads, options, tile, dq)
    }

    /// The faster dQ mode for `dtype` and `head_dim` on this context: [`DqAccumulation::Atomic`]
    /// where the Hopper backward runs (its deterministic mode waits for turns) and for a 16-bit head_dim
    /// above 128 (two warps share each slice there, and a second pass over S and dP costs more
    /// than the atomic adds), otherwise [`DqAccumulation::fastest_for`].
    pub fn dq_accumulation_for(&self, dtype: DType, head_dim: usize) -> DqAccumulation {
        self.target().dq_accumulation(dtype, head_dim)
    }

    /// The forward tile this context runs when none is given ([`Context::attention`], the
    /// command line): [`TileConfig::default_for_dtype`] (the H200's fastest) where this device's
    /// shared memory holds it, else the compiled tile that fits with the most work per block.
    pub fn default_tile(&self, dtype: DType, head_dim: usize) -> TileConfig {
        self.target().forward_tile(dtype, head_dim)
    }

    /// As [`Context::default_tile`] for the backward pass in dQ mode `dq` (every kernel of the
    /// mode must fit): [`TileConfig::default_backward_for_dtype`] where it does.
    pub fn default_backward_tile(&self, dtype: DType, head_dim: usize, dq: DqAccumulation) -> TileConfig {
        self.target().backward_tile(dtype, head_dim, dq)
    }

    /// The dQ mode and backward tile a backward with these options runs when none are given
    /// ([`Context::attention_backward`], the bridges): [`DqAccumulation::Deterministic`] if
    /// `deterministic`, else [`Context::dq_accumulation_for`]; the tile
    /// [`Context::default_backward_tile`] of that mode.
    pub fn default_backward_plan(
        &self,
        dtype: DType,
        head_dim: usize,
        deterministic: bool,
    ) -> (TileConfig, DqAccumulation) {
        let dq = match deterministic {
            true => DqAccumulation::Deterministic,
            false => self.dq_accumulation_for(dtype, head_dim),
        };
        (self.default_backward_tile(dtype, head_dim, dq), dq)
    }

    /// A short name of the kernel [`Context::flash_attention_backward`] runs with `options`, for tables:
    /// `sm_90a m64_n128_s2`, `sm_80 m64_n128_s2` or `emulated m64_n128_s2`, with ` on d192`
    /// where the head_dim runs on a larger compiled one (see [`Context::forward_kernel_label`]).
    pub fn backward_kernel_label(
        &self,
        dtype: DType,
        head_dim: usize,
        tile: TileConfig,
        dq: DqAccumulation,
        options: &AttentionOptions,
    ) -> String {
        let on = |compiled: usize| compiled_suffix(head_dim, compiled);
        let padded = TileConfig::padded_head_dim(FlashKernel::Backward, dtype, head_dim).unwrap_or(head_dim);
        if self.is_emulated() {
            return format!("emulated {tile}{}", on(padded));
        }
        match self.target().hopper_backward_for(dtype, head_dim, tile, dq, options) {
            Some(kernel) => format!("{} {}{}", KernelPath::Sm90a, kernel.config_name(), on(kernel.head_dim)),
            None => format!("{} {tile}{}", self.portable_modules(), on(padded)),
        }
    }

    /// Rounds an `f32` tensor (the dQ accumulator of the atomic backward kernels) into `out`'s
    /// 16-bit type.
    pub(crate) fn round_to<T: Element>(&self, wide: &DeviceTensor<f32>, out: &mut DeviceTensor<T>) -> Result<()> {
        let n = wide.len();
        let convert = one_dim(grid_stride_blocks(self, n.div_ceil(8), ELEMENTWISE_THREADS), ELEMENTWISE_THREADS);
        let entry =
            if T::DTYPE == DType::F16 { entry::FLASH_BWD_CONVERT_DQ_F16 } else { entry::FLASH_BWD_CONVERT_DQ_BF16 };
        self.launch(entry, convert, &[wide, &*out, &n])
    }

    /// D = rowsum(dO ∘ O), one `f32` per query row, in a new tensor.
    pub(crate) fn row_deltas<T: Element>(
        &self,
        o: &DeviceTensor<T>,
        d_o: &DeviceTensor<T>,
        shape: &AttentionShape,
    ) -> Result<DeviceTensor<f32>> {
        let delta = self.alloc_output(&shape.lse_shape())?;
        let rows = shape.query_rows();
        let config = one_dim(grid_stride_blocks(self, rows, SOFTMAX_ROWS_PER_BLOCK), SOFTMAX_THREADS);
        let entry = match T::DTYPE {
            DType::F32 => entry::FLASH_BWD_PREPROCESS_F32,
            DType::F16 => entry::FLASH_BWD_PREPROCESS_F16,
            DType::Bf16 => entry::FLASH_BWD_PREPROCESS_BF16,
        };
        self.launch(entry, config, &[o, d_o, &delta, &rows, &shape.head_dim])?;
        Ok(delta)
    }

    /// Uninitialised O and LSE tensors for `shape`, for a kernel to overwrite whole.
    pub(crate) fn alloc_attention_output<T: Element>(&self, shape: &AttentionShape) -> Result<AttentionOutput<T>> {
        Ok(AttentionOutput { o: self.alloc_output(&shape.q_shape())?, lse: self.alloc_output(&shape.lse_shape())? })
    }

    /// Uninitialised dQ, dK, dV tensors for `shape` (and dSinks if `options` has sinks).
    pub(crate) fn alloc_gradients<T: Element>(
        &self,
        shape: &AttentionShape,
        options: &AttentionOptions,
    ) -> Result<Gradients<T>> {
        Ok(Gradients {
            dq: self.alloc_output(&shape.q_shape())?,
            dk: self.alloc_output(&shape.kv_shape())?,
            dv: self.alloc_output(&shape.kv_shape())?,
            d_sinks: match options.sinks {
                Some(_) => Some(self.alloc_output(&[shape.num_heads_q])?),
                None => None,
            },
            d_bias: match options.bias {
                Some(bias) => Some(self.alloc_output(bias.shape())?),
                None => None,
            },
        })
    }

    /// Checks the attention sinks of `options` (if any) against `shape` and this context, and
    /// refuses them where they are not taken: a problem with query rows but no keys (whose LSE
    /// would be the sinks' values, which no kernel writes) and one run in chunks. Checks the
    /// mask table and the bias too ([`Context::check_mask_table`], [`Context::check_bias`]):
    /// every flash entry point calls this.
    ///
    /// # Errors
    /// [`Error::Sinks`], [`Error::MaskTable`], [`Error::Bias`].
    pub(crate) fn check_sinks(&self, shape: &AttentionShape, options: &AttentionOptions) -> Result<()> {
        self.check_mask_table(shape, options)?;
        self.check_bias(shape, options)?;
        let Some(sinks) = options.sinks else { return Ok(()) };
        sinks.check(shape, self.id())?;
        if shape.seqlen_k == 0 && shape.query_rows() > 0 {
            return Err(Error::Sinks("a problem with sinks needs seqlen_k ≥ 1".into()));
        }
        self.refuse_chunks(shape, "sinks are").map_err(Error::Sinks)
    }

    /// Checks the mask table of `options` (if any) against `shape` and this context, and
    /// refuses it for a problem run in chunks (whose folded batch entries are not the table's),
    /// prefix-LM together with a causal mask (which would undo the prefix), and a varlen table
    /// together with a causal mask, window or ALiBi of the call (aligned to the packed row, not
    /// to its sequences).
    ///
    /// # Errors
    /// [`Error::MaskTable`].
    pub(crate) fn check_mask_table(&self, shape: &AttentionShape, options: &AttentionOptions) -> Result<()> {
        let Some(table) = options.mask_table else { return Ok(()) };
        table.check(shape, self.id())?;
        if table.kind == MaskTableKind::PrefixLm && options.causal != Causal::None {
            return Err(Error::MaskTable(
                "prefix-LM is a causal mask of its own; with `Causal` the prefix's queries would not see the \
                 prefix's later keys (leave `causal` at `Causal::None`)"
                    .into(),
            ));
        }
        if table.kind == MaskTableKind::Varlen
            && (options.causal != Causal::None || options.window.is_some() || options.score.alibi.is_some())
        {
            return Err(Error::MaskTable(
                "a varlen table applies its causal mask and window to each sequence (Context::varlen_mask); the \
                 call's own causal mask, window or ALiBi would be aligned to the packed row instead (leave them out)"
                    .into(),
            ));
        }
        self.refuse_chunks(shape, "a mask table is").map_err(Error::MaskTable)
    }

    /// Checks the additive bias of `options` (if any) against `shape` and this context, and
    /// refuses it together with softcapping (whose chain rule would have to take the bias out
    /// again; no model combines them) and for a problem run in chunks (whose folded batch
    /// entries and heads are not the bias's).
    ///
    /// # Errors
    /// [`Error::Bias`].
    pub(crate) fn check_bias(&self, shape: &AttentionShape, options: &AttentionOptions) -> Result<()> {
        let Some(bias) = options.bias else { return Ok(()) };
        bias.check(shape, self.id())?;
        if options.score.softcap.is_some() {
            return Err(Error::Bias("softcapping and a bias together are not supported".into()));
        }
        self.refuse_chunks(shape, "a bias is").map_err(Error::Bias)
    }

    /// The refusal of a per-problem tensor (`what`: "sinks are", "a mask table is", "a bias
    /// is") in a problem run in chunks, whose folded batch entries and heads are not the
    /// tensor's: the reason, for the tensor's own error variant, if `shape` needs chunks.
    fn refuse_chunks(&self, shape: &AttentionShape, what: &str) -> std::result::Result<(), String> {
        match self.needs_chunks(shape) {
            true => Err(format!(
                "{} heads × {} batch entries is more than one grid holds; {what} not split into chunks",
                shape.num_heads_q, shape.batch
            )),
            false => Ok(()),
        }
    }

    /// [`Context::check_sinks`] for a backward pass, whose gradients need a dSinks then (and a
    /// dBias of the bias's shape with a bias).
    ///
    /// # Errors
    /// [`Error::Sinks`], [`Error::Bias`].
    pub(crate) fn check_backward_sinks<T: Element>(
        &self,
        shape: &AttentionShape,
        options: &AttentionOptions,
        grads: &Gradients<T>,
    ) -> Result<()> {
        self.check_sinks(shape, options)?;
        if options.sinks.is_some() && grads.d_sinks.is_none() {
            return Err(Error::Sinks("a problem with sinks needs `grads.d_sinks` for their gradient".into()));
        }
        match (options.bias, &grads.d_bias) {
            (Some(_), None) => Err(Error::Bias("a problem with a bias needs `grads.d_bias` for its gradient".into())),
            (Some(bias), Some(d_bias)) if d_bias.shape() != bias.shape() => Err(Error::Bias(format!(
                "`d_bias` must have the bias's shape {:?}; got {:?}",
                bias.shape(),
                d_bias.shape()
            ))),
            _ => Ok(()),
        }
    }

    /// The sinks' gradient ([`crate::Sinks`]) into `grads.d_sinks`, from the forward's LSE and
    /// the row deltas D of [`Context::row_deltas`]: one block per query head (the kernel
    /// `flash_bwd_sink_gradient`, deterministic). Nothing without sinks.
    pub(crate) fn sink_gradient<T: Element>(
        &self,
        shape: &AttentionShape,
        lse: &DeviceTensor<f32>,
        delta: &DeviceTensor<f32>,
        options: &AttentionOptions,
        grads: &mut Gradients<T>,
    ) -> Result<()> {
        let (Some(sinks), Some(d_sinks)) = (&options.sinks, &mut grads.d_sinks) else { return Ok(()) };
        let mut config = one_dim(shape.num_heads_q as u32, SINK_GRADIENT_THREADS);
        config.shared_mem_bytes = (SINK_GRADIENT_THREADS / 32 * 4) as u32;
        let (b, h, s) = (shape.batch, shape.num_heads_q, shape.seqlen_q);
        self.launch(entry::FLASH_BWD_SINK_GRADIENT, config, &[lse, delta, sinks, &*d_sinks, &b, &h, &s])
    }

    /// Checks owners and shapes of attention inputs and outputs; returns the problem shape.
    pub(crate) fn check_attention<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
    ) -> Result<AttentionShape> {
        for (name, t) in [("q", q), ("k", k), ("v", v), ("o", o)] {
            self.check_owner(name, t)?;
        }
        self.check_owner("lse", lse)?;
        let shape = AttentionShape::from_qkv_allowing_empty(q.shape(), k.shape(), v.shape())?;
        for (name, got, want) in [("o", o.shape(), &shape.q_shape()[..]), ("lse", lse.shape(), &shape.lse_shape()[..])]
        {
            if got != want {
                return Err(Error::Shape(format!("`{name}` must have shape {want:?}; got {got:?}")));
            }
        }
        Ok(shape)
    }

    /// The forward outputs of an empty problem ([`AttentionShape::is_empty`]: a batch, head count
    /// or sequence length of 0), with no kernel: O = 0 and LSE = −∞ for the query rows there are
    /// (rows of 0 keys, the convention of a row that sees no key). The scale is still checked.
    pub(crate) fn write_empty_forward<T: Element>(
        &self,
        shape: &AttentionShape,
        out: &mut AttentionOutput<T>,
        options: &AttentionOptions,
    ) -> Result<()> {
        options.checked_scale(shape.head_dim)?;
        self.fill_zeros(&mut out.o)?;
        out.lse.copy_from_host(&vec![f32::NEG_INFINITY; out.lse.len()])
    }

    /// The gradients of an empty problem: all 0 (no query sees a key), with no kernel.
    pub(crate) fn write_empty_backward<T: Element>(
        &self,
        shape: &AttentionShape,
        grads: &mut Gradients<T>,
        options: &AttentionOptions,
    ) -> Result<()> {
        options.checked_scale(shape.head_dim)?;
        for t in [&mut grads.dq, &mut grads.dk, &mut grads.dv] {
            self.fill_zeros(t)?;
        }
        // O = 0 in every row, so D = 0 and the sinks get no gradient either.
        if let Some(d_sinks) = &mut grads.d_sinks {
            self.fill_zeros(d_sinks)?;
        }
        if let Some(d_bias) = &mut grads.d_bias {
            self.fill_zeros(d_bias)?;
        }
        Ok(())
    }

    /// [`Context::check_attention`] plus dO and the gradients.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check_backward<T: Element>(
        &self,
        q: &DeviceTensor<T>,
        k: &DeviceTensor<T>,
        v: &DeviceTensor<T>,
        o: &DeviceTensor<T>,
        lse: &DeviceTensor<f32>,
        d_o: &DeviceTensor<T>,
        grads: &Gradients<T>,
    ) -> Result<AttentionShape> {
        let shape = self.check_attention(q, k, v, o, lse)?;
        let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
        for (name, t, want) in [
            ("d_o", d_o, q_shape),
            ("dq", &grads.dq, q_shape),
            ("dk", &grads.dk, kv_shape),
            ("dv", &grads.dv, kv_shape),
        ] {
            self.check_owner(name, t)?;
            if t.shape() != want {
                return Err(Error::Shape(format!("`{name}` must have shape {want:?}; got {:?}", t.shape())));
            }
        }
        if let Some(d_bias) = &grads.d_bias {
            self.check_owner("d_bias", d_bias)?;
        }
        if let Some(d_sinks) = &grads.d_sinks {
            self.check_owner("d_sinks", d_sinks)?;
            if d_sinks.shape() != [shape.num_heads_q] {
                return Err(Error::Shape(format!(
                    "`d_sinks` must have shape [{}]; got {:?}",
                    shape.num_heads_q,
                    d_sinks.shape()
                )));
            }
        }
        Ok(shape)
    }
}

/// Refuses an additive bias ([`crate::Bias`]) at an entry point whose kernels do not read it:
/// `kernels` names them, `instead` says what does.
///
/// # Errors
/// [`Error::Bias`].
pub(crate) fn refuse_bias(options: &AttentionOptions, kernels: &str, instead: &str) -> Result<()> {
    match options.bias {
        Some(_) => Err(Error::Bias(format!("the {kernels} do not take a bias; {instead}"))),
        None => Ok(()),
    }
}

/// Threads of the sink-gradient kernel's blocks (one block per query head).
const SINK_GRADIENT_THREADS: usize = 256;

/// The part of a kernel label that says a problem of `head_dim` runs on the larger `compiled`
/// head_dim (` on d96`); empty when they are the same.
fn compiled_suffix(head_dim: usize, compiled: usize) -> String {
    if compiled == head_dim { String::new() } else { format!(" on d{compiled}") }
}

/// Checks, without a device, that the backward takes `head_dim` at `dtype` with the built-in
/// tile: compiled (or padded) for the type.
///
/// # Errors
/// [`Error::HeadDimNotCompiled`] naming the range.
#[cfg(feature = "cli")]
pub(crate) fn check_backward_head_dim(dtype: DType, head_dim: usize) -> Result<()> {
    TileConfig::default_backward_for_dtype(dtype, head_dim).compiled_entry_for(
        FlashKernel::Backward,
        dtype,
        head_dim,
    )?;
    Ok(())
}
