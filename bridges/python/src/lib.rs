//! The Rust half of the PyTorch bridge: the Python module `rust_attention._native`, which runs
//! this project's attention kernels on memory PyTorch owns.
//!
//! The Python half (`python/rust_attention/__init__.py`) does everything that is about PyTorch:
//! it checks and lays out the tensors, allocates the outputs with PyTorch's allocator, registers
//! the `torch.library` custom ops with their autograd formula and fake (meta) kernels, and passes
//! here only what a launch needs: the device (`-1` for the CPU emulator), the raw current stream
//! (`torch.cuda.current_stream().cuda_stream`), the element type, the problem's sizes and each
//! tensor's `data_ptr()`. This half wraps those pointers as borrowed [`DeviceTensor`]s
//! ([`Context::tensor_from_raw_parts`]: read and written in place, never freed) on a context that
//! runs on PyTorch's stream ([`Context::with_raw_stream`]), and queues the kernels: nothing
//! synchronises, exactly as for a PyTorch kernel.
//!
//! One [`Context`] per device holds the loaded kernels; one more per (device, stream) shares them
//! and keeps its own tensor-map cache. Both are made on first use and kept for the process.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use attn_host::{
    Alibi, AttentionOptions, AttentionOutput, AttentionShape, Causal, Context, DType, DeviceTensor, Element, Error,
    Gradients, MaskTable, SlidingWindow, bf16, f16,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// `(batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim)`, as Python passes it.
type Sizes = (usize, usize, usize, usize, usize, usize);

/// The mask, as Python passes it: whether it is causal; whether its diagonal (and a window's)
/// is aligned to the bottom-right corner (FlashAttention's) rather than the top-left
/// (PyTorch's `is_causal`); a sliding window's left and right reach, `-1` for no edge.
#[derive(Clone, Copy)]
struct MaskArgs {
    causal: bool,
    bottom_right: bool,
    window_left: i64,
    window_right: i64,
}

/// The score modifications, as Python passes them: softcapping's cap and ALiBi's `max_bias`
/// (0: none). (The sinks, a tensor, come with the pointers.)
#[derive(Clone, Copy)]
struct ScoreArgs {
    softcap: f32,
    alibi_max_bias: f32,
}

/// The contexts of this process: per device (`-1` the emulator), and per (device, stream).
struct Contexts {
    devices: HashMap<i64, Arc<Context>>,
    streams: HashMap<(i64, usize), Arc<Context>>,
}

fn contexts() -> &'static Mutex<Contexts> {
    static CONTEXTS: OnceLock<Mutex<Contexts>> = OnceLock::new();
    CONTEXTS.get_or_init(|| Mutex::new(Contexts { devices: HashMap::new(), streams: HashMap::new() }))
}

/// The context for `device` on the raw CUDA stream `stream` (ignored on the emulator).
fn context(device: i64, stream: usize) -> Result<Arc<Context>, Error> {
    let mut all = contexts().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(ctx) = all.streams.get(&(device, stream)) {
        return Ok(ctx.clone());
    }
    let base = match all.devices.get(&device) {
        Some(ctx) => ctx.clone(),
        None => {
            let ctx = Arc::new(if device < 0 {
                Context::cpu_emulated()
            } else {
                let ctx = Context::new(device as usize)?;
                // Every tensor of a call is used on the one stream the call runs on, in stream
                // order, so cudarc's per-buffer events (made for work spread over several
                // streams) would only cost two event creations per tensor per call.
                if let Some(stream) = ctx.cuda_stream() {
                    // SAFETY: no buffer of this context is shared between streams.
                    unsafe { stream.context().disable_event_tracking() };
                }
                ctx
            });
            all.devices.insert(device, ctx.clone());
            ctx
        }
    };
    let ctx = if device < 0 {
        base
    } else {
        // SAFETY: PyTorch's current stream of `device` lives as long as the process uses it,
        // and it belongs to the device's primary context, which `Context::new` retains.
        Arc::new(unsafe { base.with_raw_stream(stream as *mut std::ffi::c_void) }?)
    };
    all.streams.insert((device, stream), ctx.clone());
    Ok(ctx)
}

/// A Python exception for `error`: `ValueError` for what the caller passed, `RuntimeError` for
/// what the device said.
fn to_py(error: Error) -> PyErr {
    match error {
        Error::Driver { .. } | Error::NoDriver | Error::NoDevice { .. } | Error::UnsupportedDevice { .. } => {
            PyRuntimeError::new_err(error.to_string())
        }
        _ => PyValueError::new_err(error.to_string()),
    }
}

fn shape_of(s: Sizes) -> AttentionShape {
    let (batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim) = s;
    AttentionShape { batch, num_heads_q, num_heads_kv, seqlen_q, seqlen_k, head_dim }
}

fn options_of(
    mask: MaskArgs,
    score: ScoreArgs,
    scale: Option<f32>,
    deterministic: bool,
) -> PyResult<AttentionOptions<'static>> {
    let causal = match (mask.causal, mask.bottom_right) {
        (false, _) => Causal::None,
        (true, false) => Causal::TopLeft,
        (true, true) => Causal::BottomRight,
    };
    let reach = |x: i64| match x {
        -1 => Ok(None),
        x => usize::try_from(x).map(Some).map_err(|_| PyValueError::new_err(format!("a window reach of {x}"))),
    };
    let mut options = AttentionOptions { scale, causal, ..Default::default() };
    let (left, right) = (reach(mask.window_left)?, reach(mask.window_right)?);
    if left.is_some() || right.is_some() {
        let window = SlidingWindow::new(left, right);
        options = options.with_window(if mask.bottom_right { window } else { window.top_left() });
    }
    if score.softcap != 0.0 {
        options = options.with_softcap(score.softcap);
    }
    if score.alibi_max_bias != 0.0 {
        options = options.with_alibi(Alibi { max_bias: score.alibi_max_bias });
    }
    options.deterministic = deterministic;
    Ok(options)
}

/// The sinks at `address` (`[num_heads_q]` float32), if there are any.
fn sinks_of(ctx: &Context, address: u64, shape: &AttentionShape) -> Result<Option<DeviceTensor<f32>>, Error> {
    (address != 0).then(|| borrow::<f32>(ctx, address, &[shape.num_heads_q])).transpose()
}

/// An additive bias as Python passes it (SDPA's float `attn_mask`, made contiguous `float32`):
/// its address (0: none) and its two leading sizes, `(batch or 1, num_heads_q or 1)`; the last
/// two are the problem's `seqlen_q` and `seqlen_k`. The library checks the sizes.
#[derive(Clone, Copy)]
struct BiasArgs {
    address: u64,
    batch: usize,
    heads: usize,
}

impl BiasArgs {
    /// The bias (or its gradient) at `address` with this bias's shape, if there is one.
    fn at(&self, ctx: &Context, address: u64, shape: &AttentionShape) -> Result<Option<DeviceTensor<f32>>, Error> {
        let dims = [self.batch, self.heads, shape.seqlen_q, shape.seqlen_k];
        (address != 0).then(|| borrow::<f32>(ctx, address, &dims)).transpose()
    }
}

/// The mask table of a packed row, if the call has one (FlashAttention's variable-length
/// convention): from `cu_seqlens` alone a document mask (document `d` holds queries and keys
/// `cu_seqlens[d] .. cu_seqlens[d + 1]`); with `cu_seqlens_k` too a varlen table
/// (`Context::varlen_mask`: sequence `s` holds keys `cu_seqlens_k[s] .. cu_seqlens_k[s + 1]`),
/// which takes over `options`' causal mask and window to apply them to each sequence on its own
/// lengths. Built on `ctx` for each call: a host loop over the row and one upload, freed in
/// stream order after the kernels that read it. (An empty list is an error of the library's,
/// not "no mask".)
fn table_of(
    ctx: &Context,
    cu_seqlens: Option<&[i32]>,
    cu_seqlens_k: Option<&[i32]>,
    options: &mut AttentionOptions,
) -> Result<Option<MaskTable>, Error> {
    match (cu_seqlens, cu_seqlens_k) {
        (Some(cu_q), Some(cu_k)) => {
            let (causal, window) = (options.causal, options.window.take());
            options.causal = Causal::None;
            ctx.varlen_mask(cu_q, cu_k, causal, window).map(Some)
        }
        (Some(cu), None) => ctx.document_mask_from_cu_seqlens(cu).map(Some),
        (None, Some(_)) => Err(Error::MaskTable("cu_seqlens_k without cu_seqlens (the queries' offsets)".into())),
        (None, None) => Ok(None),
    }
}

/// `options` with the call's sinks, bias and document mask, where it has them.
fn with_tensors<'a>(
    options: &AttentionOptions<'a>,
    sinks: &'a Option<DeviceTensor<f32>>,
    bias: &'a Option<DeviceTensor<f32>>,
    documents: &'a Option<MaskTable>,
) -> AttentionOptions<'a> {
    let mut options = *options;
    if let Some(sinks) = sinks {
        options = options.with_sinks(sinks);
    }
    if let Some(bias) = bias {
        options = options.with_bias(bias);
    }
    if let Some(documents) = documents {
        options = options.with_mask_table(documents);
    }
    options
}

/// A borrowed tensor of `shape` at `address`.
fn borrow<T: Element>(ctx: &Context, address: u64, shape: &[usize]) -> Result<DeviceTensor<T>, Error> {
    // SAFETY: the Python side passes the data_ptr() of a live, contiguous tensor of this shape
    // and type on this device, kept alive across the call (and the queued kernels use it in
    // stream order on PyTorch's current stream, as PyTorch's own kernels do).
    unsafe { ctx.tensor_from_raw_parts::<T>(address, shape) }
}

/// Pointers of one forward call: Q, K, V (and the sinks and the bias, 0 for none) in, O and
/// LSE out.
struct ForwardPointers {
    q: u64,
    k: u64,
    v: u64,
    sinks: u64,
    bias: BiasArgs,
    o: u64,
    lse: u64,
}

fn forward_typed<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    p: &ForwardPointers,
    options: &AttentionOptions,
    (cu_seqlens, cu_seqlens_k): (Option<&[i32]>, Option<&[i32]>),
) -> Result<(), Error> {
    let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
    let (q, k, v) =
        (borrow::<T>(ctx, p.q, &q_shape)?, borrow::<T>(ctx, p.k, &kv_shape)?, borrow::<T>(ctx, p.v, &kv_shape)?);
    let mut out =
        AttentionOutput { o: borrow::<T>(ctx, p.o, &q_shape)?, lse: borrow::<f32>(ctx, p.lse, &shape.lse_shape())? };
    let sinks = sinks_of(ctx, p.sinks, &shape)?;
    let bias = p.bias.at(ctx, p.bias.address, &shape)?;
    let mut options = *options;
    let table = table_of(ctx, cu_seqlens, cu_seqlens_k, &mut options)?;
    let options = with_tensors(&options, &sinks, &bias, &table);
    let tile = ctx.default_tile(T::DTYPE, shape.head_dim);
    ctx.flash_attention_forward_into(&q, &k, &v, &mut out, &options, tile)
}

/// Pointers of one backward call: Q, K, V, the sinks, the bias, O, LSE and dO in, dQ, dK, dV
/// (and dSinks where there are sinks, dBias where there is a bias) out.
struct BackwardPointers {
    forward: ForwardPointers,
    d_o: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    d_sinks: u64,
    d_bias: u64,
}

fn backward_typed<T: Element>(
    ctx: &Context,
    shape: AttentionShape,
    p: &BackwardPointers,
    options: &AttentionOptions,
    (cu_seqlens, cu_seqlens_k): (Option<&[i32]>, Option<&[i32]>),
) -> Result<(), Error> {
    let (q_shape, kv_shape) = (shape.q_shape(), shape.kv_shape());
    let f = &p.forward;
    let (q, k, v) =
        (borrow::<T>(ctx, f.q, &q_shape)?, borrow::<T>(ctx, f.k, &kv_shape)?, borrow::<T>(ctx, f.v, &kv_shape)?);
    let (o, lse, d_o) = (
        borrow::<T>(ctx, f.o, &q_shape)?,
        borrow::<f32>(ctx, f.lse, &shape.lse_shape())?,
        borrow::<T>(ctx, p.d_o, &q_shape)?,
    );
    let mut grads = Gradients {
        dq: borrow::<T>(ctx, p.dq, &q_shape)?,
        dk: borrow::<T>(ctx, p.dk, &kv_shape)?,
        dv: borrow::<T>(ctx, p.dv, &kv_shape)?,
        d_sinks: sinks_of(ctx, p.d_sinks, &shape)?,
        d_bias: f.bias.at(ctx, p.d_bias, &shape)?,
    };
    let sinks = sinks_of(ctx, f.sinks, &shape)?;
    let bias = f.bias.at(ctx, f.bias.address, &shape)?;
    let mut options = *options;
    let table = table_of(ctx, cu_seqlens, cu_seqlens_k, &mut options)?;
    let options = with_tensors(&options, &sinks, &bias, &table);
    let (tile, dq_mode) = ctx.default_backward_plan(T::DTYPE, shape.head_dim, options.deterministic);
    ctx.flash_attention_backward_into(&q, &k, &v, &o, &lse, &d_o, &mut grads, &options, tile, dq_mode)
}

/// Calls `$f::<T>($args…)` with `T` the element type of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            DType::F32 => $f::<f32>($($arg),*),
            DType::F16 => $f::<f16>($($arg),*),
            DType::Bf16 => $f::<bf16>($($arg),*),
        }
    };
}

fn dtype_of(name: &str) -> PyResult<DType> {
    match name {
        "float32" => Ok(DType::F32),
        "float16" => Ok(DType::F16),
        "bfloat16" => Ok(DType::Bf16),
        other => Err(PyValueError::new_err(format!("dtype {other} is not float32, float16 or bfloat16"))),
    }
}

/// Attention forward on PyTorch's memory: O (`[B, Hq, Sq, D]`, the inputs' type) and LSE
/// (`[B, Hq, Sq]` float32, natural log) written at `o` and `lse`, from contiguous Q `[B, Hq, Sq,
/// D]` and K, V `[B, Hkv, Sk, D]` at `q`, `k`, `v`; `softcap` and `alibi_max_bias` (0: none)
/// modify the scores, `sinks` (0: none) is the address of `[Hq]` float32 sink logits, `bias`
/// (0: none) that of a contiguous float32 additive bias `[bias_dims.0, bias_dims.1, Sq, Sk]`
/// (each of the two 1 or B, Hq: broadcast), added to the scaled scores, and `cu_seqlens` (None:
/// none) makes a document mask of the (single, packed) row: each query sees only the keys of its
/// own document; with `cu_seqlens_k` the keys have lengths of their own (`table_of`). Queued on
/// `stream`; returns at once.
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, sizes, q, k, v, o, lse, causal, bottom_right, window_left, window_right, scale=None, softcap=0.0, alibi_max_bias=0.0, sinks=0, cu_seqlens=None, cu_seqlens_k=None, bias=0, bias_dims=(1, 1)))]
#[allow(clippy::too_many_arguments)]
fn forward(
    py: Python<'_>,
    device: i64,
    stream: usize,
    dtype: &str,
    sizes: Sizes,
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    causal: bool,
    bottom_right: bool,
    window_left: i64,
    window_right: i64,
    scale: Option<f32>,
    softcap: f32,
    alibi_max_bias: f32,
    sinks: u64,
    cu_seqlens: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    bias: u64,
    bias_dims: (usize, usize),
) -> PyResult<()> {
    let dtype = dtype_of(dtype)?;
    let mask = MaskArgs { causal, bottom_right, window_left, window_right };
    let options = options_of(mask, ScoreArgs { softcap, alibi_max_bias }, scale, false)?;
    let offsets = (cu_seqlens.as_deref(), cu_seqlens_k.as_deref());
    let bias = BiasArgs { address: bias, batch: bias_dims.0, heads: bias_dims.1 };
    let pointers = ForwardPointers { q, k, v, sinks, bias, o, lse };
    py.detach(|| {
        let ctx = context(device, stream)?;
        by_dtype!(dtype, forward_typed(&ctx, shape_of(sizes), &pointers, &options, offsets))
    })
    .map_err(to_py)
}

/// Attention backward on PyTorch's memory: dQ, dK, dV written at `dq`, `dk`, `dv` (Q's and K's
/// shapes and type), with sinks their gradient at `d_sinks` (`[Hq]` float32), and with a bias
/// its gradient at `d_bias` (the bias's shape, float32; required with a bias), from the
/// forward's inputs and options (`cu_seqlens` and the bias included), O and LSE and from dO
/// (O's shape). `deterministic` sums dQ in a fixed order, bit-identical on every run. Queued on
/// `stream`; returns at once.
#[pyfunction]
#[pyo3(signature = (device, stream, dtype, sizes, q, k, v, o, lse, d_o, dq, dk, dv, causal, bottom_right, window_left, window_right, deterministic, scale=None, softcap=0.0, alibi_max_bias=0.0, sinks=0, d_sinks=0, cu_seqlens=None, cu_seqlens_k=None, bias=0, bias_dims=(1, 1), d_bias=0))]
#[allow(clippy::too_many_arguments)]
fn backward(
    py: Python<'_>,
    device: i64,
    stream: usize,
    dtype: &str,
    sizes: Sizes,
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    lse: u64,
    d_o: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    causal: bool,
    bottom_right: bool,
    window_left: i64,
    window_right: i64,
    deterministic: bool,
    scale: Option<f32>,
    softcap: f32,
    alibi_max_bias: f32,
    sinks: u64,
    d_sinks: u64,
    cu_seqlens: Option<Vec<i32>>,
    cu_seqlens_k: Option<Vec<i32>>,
    bias: u64,
    bias_dims: (usize, usize),
    d_bias: u64,
) -> PyResult<()> {
    let dtype = dtype_of(dtype)?;
    let mask = MaskArgs { causal, bottom_right, window_left, window_right };
    let options = options_of(mask, ScoreArgs { softcap, alibi_max_bias }, scale, deterministic)?;
    let offsets = (cu_seqlens.as_deref(), cu_seqlens_k.as_deref());
    let bias = BiasArgs { address: bias, batch: bias_dims.0, heads: bias_dims.1 };
    let forward = ForwardPointers { q, k, v, sinks, bias, o, lse };
    let pointers = BackwardPointers { forward, d_o, dq, dk, dv, d_sinks, d_bias };
    py.detach(|| {
        let ctx = context(device, stream)?;
        by_dtype!(dtype, backward_typed(&ctx, shape_of(sizes), &pointers, &options, offsets))
    })
    .map_err(to_py)
}

/// The forward kernel a call would run, e.g. `sm_90a m128_n128_s2 persistent`, for logs and
/// benchmarks; `bias` and `bias_dims` as in `forward` (a problem with a bias runs the sm_80
/// kernels on every GPU).
#[pyfunction]
#[pyo3(signature = (device, dtype, sizes, causal, bottom_right, bias=0, bias_dims=(1, 1)))]
fn forward_kernel(
    device: i64,
    dtype: &str,
    sizes: Sizes,
    causal: bool,
    bottom_right: bool,
    bias: u64,
    bias_dims: (usize, usize),
) -> PyResult<String> {
    let dtype = dtype_of(dtype)?;
    let mask = MaskArgs { causal, bottom_right, window_left: -1, window_right: -1 };
    let options = options_of(mask, ScoreArgs { softcap: 0.0, alibi_max_bias: 0.0 }, None, false)?;
    let ctx = context(device, 0).map_err(to_py)?;
    let shape = shape_of(sizes);
    let bias =
        BiasArgs { address: bias, batch: bias_dims.0, heads: bias_dims.1 }.at(&ctx, bias, &shape).map_err(to_py)?;
    let (no_sinks, no_table) = (None, None);
    let options = with_tensors(&options, &no_sinks, &bias, &no_table);
    let tile = ctx.default_tile(dtype, shape.head_dim);
    Ok(ctx.forward_kernel_label(dtype, &shape, tile, &options))
}

/// The device a context opens for `device` (`-1`: the CPU emulator), e.g. `NVIDIA H200`.
#[pyfunction]
fn device_name(device: i64) -> PyResult<String> {
    Ok(context(device, 0).map_err(to_py)?.device().name.clone())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(forward_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(device_name, m)?)?;
    Ok(())
}
