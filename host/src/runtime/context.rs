//! **Runtime layer.** The context: a CUDA device with one stream and the embedded PTX modules
//! (each compiled by the driver the first time one of its kernels runs), or the CPU emulator running the same kernels' source on the host. It owns what
//! needs the device: tensors' memory ([`Context::upload`]), kernel launches (`Context::launch`),
//! the kernel path and the tensor-map cache. The attention operations on it are in
//! [`crate::ops`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use attn_kernels::emu::{Arg, Launch};
use cudarc::driver::sys::{
    CUdevice_attribute, CUfunction_attribute, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::kernel_arg::KernelArg;
use super::tensor::{DeviceTensor, HostBuffer, Storage, element_count};
use super::tensor_map::{TensorMapCache, TensorMaps};
use crate::device::{Device, DeviceInfo, GpuProfile};
use crate::dtype::{DType, Element, Scalar};
use crate::error::{During, Error, Result};
use crate::kernels;
use crate::select::{KernelPath, Target};

/// A CUDA device with the kernels of this crate loaded, and the stream every operation runs on;
/// or the CPU emulator ([`Context::cpu_emulated`]).
///
/// Creating a GPU context loads the driver library at run time, so programs that use this crate
/// build and start on machines without a GPU; [`Context::new`] then returns [`Error::NoDriver`]
/// or [`Error::NoDevice`]. All operations are queued on one stream and are therefore ordered;
/// reads back to the host ([`DeviceTensor::to_host`]) wait for them. On the emulator every
/// operation runs to completion before it returns.
pub struct Context {
    /// Unique per context: tensors record it, so that one context refuses another's tensors.
    id: u64,
    pub(crate) backend: Backend,
    info: DeviceInfo,
    /// Which kernels run the 16-bit forward pass ([`KernelPath`]).
    pub(crate) kernel_path: KernelPath,
    /// The most blocks a flash kernel's grid may have in y (heads) and z (batch): CUDA's 65,535,
    /// above which a problem runs in chunks (`ops/mod.rs`); lower only in tests.
    pub(crate) grid_limit: usize,
}

pub(crate) enum Backend {
    Cuda {
        cuda: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        modules: Arc<Modules>,
        /// The Hopper kernels' tensor maps already in device memory, by content
        /// ([`TensorMapCache`]).
        tensor_maps: TensorMapCache,
        /// [`Context::kernel_blocks_per_sm`]'s answers, by (entry, threads, shared memory): a
        /// decoding step asks on every call, and the answer never changes.
        occupancy: Mutex<HashMap<(String, usize, usize), usize>>,
    },
    Emulated,
}

fn next_context_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The oldest compute capability the embedded PTX runs on: Turing, with its `sm_75` modules
/// (the `f32` and `f16` kernels; `bf16` needs 8.0).
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (7, 5);

/// What a `bf16` call on Turing is refused as ([`Error::Unsupported`]).
const BF16_ON_TURING: &str = "bf16 (Turing's tensor cores have no bf16 products: use f16 or f32)";

/// The compute capability the emulator reports: it runs the `sm_80` kernels' source (a GPU
/// below it runs Turing's `sm_75` modules, [`DeviceInfo::runs_turing_modules`]).
const SM80: (i32, i32) = (8, 0);

/// The kernels on one CUDA context, each loaded as a PTX module of its own
/// ([`kernels::module_entry_ptx`], from the module [`Modules::module_of`] picks) the first time
/// it is looked up. The driver compiles a PTX module for the GPU when it is loaded, a whole
/// module at once: the tensor-core module's hundreds of
/// kernels took minutes on an H200 whose driver cache did not hold them, one kernel takes a
/// fraction of a second. So a program compiles only the kernels it runs, on their first call.
/// (Under CUDA graph capture, run each call once before capturing, as for any library that
/// compiles on first use.)
pub(crate) struct Modules {
    cuda: Arc<CudaContext>,
    /// Whether this GPU runs the kernels of module `i`: the sm_80 modules run on every GPU from
    /// Ampere on, the sm_90a one (Hopper's `wgmma` and TMA) only on compute capability 9.0, the
    /// sm_75 ones on Turing only.
    runnable: Vec<bool>,
    /// A Turing GPU (compute capability 7.5): kernels come from the sm_75 modules, by the same
    /// names ([`kernels::turing_module_of`]).
    turing: bool,
    /// The kernels looked up so far, by entry name: a slot each, filled by the first lookup.
    loaded: Mutex<HashMap<String, Slot>>,
}

/// A kernel's place in [`Modules`]: empty until its first lookup has loaded it (or after a
/// failed load, which the next lookup tries again).
type Slot = Arc<Mutex<Option<Arc<CudaModule>>>>;

impl Modules {
    fn new(cuda: Arc<CudaContext>, info: &DeviceInfo) -> Self {
        let turing = info.runs_turing_modules();
        let runnable = kernels::MODULE_ARCHS
            .iter()
            .map(|&arch| match arch {
                "sm_90a" => info.compute_capability == (9, 0),
                "sm_75" => turing,
                _ => !turing,
            })
            .collect();
        Self { cuda, runnable, turing, loaded: Mutex::new(HashMap::new()) }
    }

    /// The module that holds kernel `entry` on this GPU.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a kernel this GPU cannot run: an sm_90a one off compute
    /// capability 9.0, a `bf16` one on Turing.
    fn module_of(&self, entry: &str, device: &str) -> Result<usize> {
        let index = kernels::module_of(entry);
        let unsupported = |what| Error::Unsupported { what, device: device.to_string() };
        if self.turing {
            return match kernels::turing_module_of(entry) {
                Some(index) => Ok(index),
                // (The entry points refuse bf16 first, `Context::require_dtype`: this is the backstop.)
                None if entry.contains("_bf16") => Err(unsupported(BF16_ON_TURING)),
                None if kernels::MODULE_ARCHS[index] == "sm_90a" => {
                    Err(unsupported("this kernel's sm_90a module (compute capability 9.0)"))
                }
                // A name of no kernel: `function` says so.
                None => Ok(index),
            };
        }
        if !self.runnable[index] {
            return Err(unsupported("this kernel's sm_90a module (compute capability 9.0)"));
        }
        Ok(index)
    }

    /// Kernel `entry`, loaded (and compiled by the driver) on the first call.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a kernel of the sm_90a module off compute capability 9.0, or
    /// a `bf16` kernel on Turing; [`Error::Argument`] for a name of no kernel; [`Error::Driver`]
    /// if the driver cannot load it.
    fn function(&self, entry: &str, device: &str) -> Result<CudaFunction> {
        let index = self.module_of(entry, device)?;
        // The map is locked only to find the kernel's slot; the slot is locked while the driver
        // compiles the kernel, so threads that need other kernels compile theirs meanwhile and
        // those that need this one wait for it.
        let slot = {
            let mut loaded = self.loaded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            match loaded.get(entry) {
                Some(slot) => slot.clone(),
                None => loaded.entry(entry.to_string()).or_default().clone(),
            }
        };
        let mut slot = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let module = match &*slot {
            Some(module) => module.clone(),
            None => {
                let (group, arch) = (kernels::MODULES[index], kernels::MODULE_ARCHS[index]);
                // A name of no kernel is refused here, rather than by compiling a whole module
                // (minutes) to learn that it is not in it.
                let ptx = kernels::module_entry_ptx(index, entry)
                    .ok_or_else(|| Error::Argument(format!("no kernel named {entry} in the PTX")))?;
                let module = self
                    .cuda
                    .load_module(Ptx::from_src(ptx))
                    .during(format!("loading kernel {entry} (module {group}, {arch})"))?;
                *slot = Some(module.clone());
                module
            }
        };
        module.load_function(entry).during(format!("looking up kernel {entry}"))
    }
}

impl Context {
    /// Opens device `ordinal`. Its kernels load on first use, each on its own (the driver
    /// compiles each for the device then, several at once from several threads: [`Modules`]), so
    /// a driver that cannot compile them fails the first call that needs them.
    ///
    /// # Errors
    /// [`Error::NoDriver`] without an NVIDIA driver, [`Error::NoDevice`] for a missing ordinal,
    /// [`Error::UnsupportedDevice`] below compute capability 7.5 (the device's, or its
    /// [`GpuProfile`]'s), [`Error::Argument`] for an unknown value of [`KernelPath::ENV`] or
    /// [`GpuProfile::ENV`], [`Error::Unsupported`] when it asks for `sm90a` off
    /// Hopper, [`Error::Driver`] otherwise.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        let count = CudaContext::device_count().during("counting CUDA devices")?.max(0) as usize;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let cuda = CudaContext::new(ordinal).during(format!("creating a context on device {ordinal}"))?;
        let stream = cuda.new_stream().during("creating a stream")?;
        Self::with_cuda(cuda, stream)
    }

    /// A context whose operations all run on the caller's `stream` (and its CUDA context), so
    /// that they are ordered with the caller's own work on it: a framework's current stream, for
    /// instance. Tensors the caller made on the same CUDA context can join it
    /// ([`Context::tensor_from_cuda_slice`]).
    ///
    /// # Errors
    /// As [`Context::new`].
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self> {
        Self::with_cuda(stream.context().clone(), stream)
    }

    /// This context's kernels on another `stream` of the same CUDA context: a framework's current
    /// stream, which may change from call to call. The loaded modules are shared (nothing is
    /// compiled again), so this is cheap; the new context has its own id, so it takes only the
    /// tensors it makes itself (borrowed ones, for instance: [`Context::tensor_from_raw_parts`]).
    ///
    /// # Errors
    /// [`Error::NotOnEmulator`] on the emulator; [`Error::Shape`] for a stream of another CUDA
    /// context.
    pub fn with_stream(&self, stream: Arc<CudaStream>) -> Result<Self> {
        let Backend::Cuda { cuda, modules, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("CUDA streams"));
        };
        if stream.context().cu_ctx() != cuda.cu_ctx() {
            return Err(Error::Shape(format!(
                "the stream belongs to another CUDA context (device {}) than this context's (device {})",
                stream.context().ordinal(),
                self.info.ordinal
            )));
        }
        Ok(Self {
            id: next_context_id(),
            backend: Backend::Cuda {
                cuda: cuda.clone(),
                stream,
                modules: modules.clone(),
                tensor_maps: Default::default(),
                occupancy: Default::default(),
            },
            info: self.info.clone(),
            kernel_path: self.kernel_path,
            grid_limit: self.grid_limit,
        })
    }

    /// [`Context::with_stream`] for a raw `CUstream` (`cudaStream_t`) of this context's device,
    /// such as `torch.cuda.current_stream().cuda_stream`; null is the legacy default stream.
    /// The stream is borrowed: it is not destroyed with the context.
    ///
    /// # Safety
    /// `cu_stream` is null or a live stream of this context's CUDA context (the device's primary
    /// context, which the CUDA runtime and so PyTorch use), and outlives the context returned.
    ///
    /// # Errors
    /// As [`Context::with_stream`].
    pub unsafe fn with_raw_stream(&self, cu_stream: *mut std::ffi::c_void) -> Result<Self> {
        let Backend::Cuda { cuda, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("CUDA streams"));
        };
        // SAFETY: the caller's contract.
        let stream = unsafe { cuda.wrap_borrowed_stream(cu_stream as cudarc::driver::sys::CUstream) };
        self.with_stream(stream)
    }

    /// [`Context::new`] and [`Context::on_stream`] on the CUDA context `cuda` and `stream`: reads
    /// the device (its kernel modules load on first use: [`Modules`]).
    fn with_cuda(cuda: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<Self> {
        let ordinal = cuda.ordinal();
        let attribute = |attribute| cuda.attribute(attribute).during("reading device attributes");
        let info = DeviceInfo {
            ordinal,
            name: cuda.name().during("reading the device name")?,
            compute_capability: cuda.compute_capability().during("reading the compute capability")?,
            sm_count: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
            max_shared_memory_per_block: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )? as usize,
            total_memory: cuda.total_mem().during("reading the memory size")?,
        };
        // A smaller GPU's limits, where the environment asks for them (`GpuProfile`).
        let info = match GpuProfile::from_env().map_err(|e| Error::Argument(format!("{}: {e}", GpuProfile::ENV)))? {
            Some(profile) => profile.apply(&info),
            None => info,
        };
        if info.compute_capability < MIN_COMPUTE_CAPABILITY {
            let (major, minor) = info.compute_capability;
            return Err(Error::UnsupportedDevice { name: info.name, major, minor, needed: "7.5 (Turing)" });
        }
        let hopper = info.compute_capability == (9, 0);
        let modules = Arc::new(Modules::new(cuda.clone(), &info));
        let preferred = if hopper { KernelPath::Sm90a } else { KernelPath::Sm80 };
        let context = Self {
            id: next_context_id(),
            backend: Backend::Cuda {
                cuda,
                stream,
                modules,
                tensor_maps: Default::default(),
                occupancy: Default::default(),
            },
            info,
            kernel_path: KernelPath::Sm80,
            grid_limit: crate::problem::MAX_GRID_YZ,
        };
        context.with_kernel_path(KernelPath::from_env()?.unwrap_or(preferred))
    }

    /// The CPU emulator: the kernels' own source, run on the host with one OS thread per GPU
    /// thread (see [`Device::CpuEmulated`]). It needs no GPU and never fails to open. It reports
    /// itself as a device with one SM, so that grid-stride kernels launch few blocks, and with a
    /// Hopper's 227 KiB of shared memory per block, so that every compiled tile runs.
    ///
    /// Under a [`GpuProfile`] ([`GpuProfile::ENV`]) it takes the profile's shared memory per
    /// block and name (not its compute capability: the emulator runs the sm_80 kernels whatever
    /// the profile); an unknown profile name is ignored here (a GPU context reports it).
    pub fn cpu_emulated() -> Self {
        let info = DeviceInfo {
            ordinal: 0,
            name: "CPU emulator".into(),
            compute_capability: SM80,
            sm_count: 1,
            max_shared_memory_per_block: crate::layout::HOPPER_SMEM_PER_BLOCK,
            total_memory: 0,
        };
        let info = match GpuProfile::from_env() {
            Ok(Some(profile)) => DeviceInfo { compute_capability: SM80, ..profile.apply(&info) },
            _ => info,
        };
        Self {
            id: next_context_id(),
            backend: Backend::Emulated,
            info,
            kernel_path: KernelPath::Sm80,
            grid_limit: crate::problem::MAX_GRID_YZ,
        }
    }

    /// Opens `device`: [`Context::new`] for a GPU, [`Context::cpu_emulated`] for the emulator.
    pub fn open(device: Device) -> Result<Self> {
        match device {
            Device::Gpu(ordinal) => Self::new(ordinal),
            Device::CpuEmulated => Ok(Self::cpu_emulated()),
        }
    }

    /// The device this context runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// Whether this is the CPU emulator.
    pub fn is_emulated(&self) -> bool {
        matches!(self.backend, Backend::Emulated)
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The stream every operation is queued on; `None` on the emulator.
    pub fn cuda_stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.backend {
            Backend::Cuda { stream, .. } => Some(stream),
            Backend::Emulated => None,
        }
    }

    /// Waits until everything queued so far has finished; reports a failed kernel.
    pub fn synchronize(&self) -> Result<()> {
        match &self.backend {
            Backend::Cuda { stream, .. } => stream.synchronize().during("waiting for the GPU"),
            Backend::Emulated => Ok(()),
        }
    }

    /// (free, total) device memory in bytes, as the driver reports it now.
    ///
    /// # Errors
    /// [`Error::NotOnEmulator`] on the emulator.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        match &self.backend {
            Backend::Cuda { cuda, .. } => cuda.mem_get_info().during("reading free device memory"),
            Backend::Emulated => Err(Error::NotOnEmulator("device memory information")),
        }
    }

    /// Runs `work` and returns its result with the most device memory it held at once beyond
    /// what was allocated before it started, in bytes: the high-water mark of the device's
    /// memory pool, from which this crate's tensors and workspaces are allocated (stream-ordered,
    /// `cuMemAllocAsync`). Waits for the GPU before and after `work`. An error from `work` is
    /// returned as is. The pool is the device's: allocations made meanwhile by other threads (or
    /// other contexts on the device) count too, so measure with nothing else running.
    ///
    /// # Errors
    /// [`Error::NotOnEmulator`] on the emulator; [`Error::Unsupported`] on a device without
    /// memory pools; [`Error::Driver`].
    pub fn peak_memory<R>(&self, work: impl FnOnce() -> Result<R>) -> Result<(R, usize)> {
        use cudarc::driver::sys::CUmemPool_attribute::{
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT, CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        };
        let Backend::Cuda { cuda, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("device memory measurement"));
        };
        if !cuda.has_async_alloc() {
            return Err(Error::Unsupported { what: "memory pools", device: self.info.name.clone() });
        }
        // SAFETY: the device handle comes from a live context.
        let pool = unsafe { cudarc::driver::result::device::get_default_mem_pool(cuda.cu_device()) }
            .during("looking up the device's memory pool")?;
        self.synchronize()?;
        let before = pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, None)?;
        // Writing 0 resets the high-water mark to the current usage.
        pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, Some(0))?;
        let result = work()?;
        self.synchronize()?;
        let high = pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH, None)?;
        Ok((result, high.saturating_sub(before) as usize))
    }

    /// Registers per thread and local (spilled) bytes per thread of a kernel, as the driver
    /// compiled it for this device.
    ///
    /// # Errors
    /// [`Error::NotOnEmulator`] on the emulator.
    pub fn kernel_resources(&self, entry: &str) -> Result<(usize, usize)> {
        let function = self.function(entry)?;
        let regs = function.num_regs().during(format!("reading the registers of {entry}"))?;
        let local = function.local_size_bytes().during(format!("reading the local memory of {entry}"))?;
        Ok((regs as usize, local as usize))
    }

    /// Blocks of `entry` that can be resident on one SM at once when launched with `threads`
    /// threads and `shared_memory_bytes` of dynamic shared memory per block: what registers,
    /// shared memory and threads allow together (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
    ///
    /// # Errors
    /// [`Error::NotOnEmulator`] on the emulator; [`Error::Driver`].
    pub fn kernel_blocks_per_sm(&self, entry: &str, threads: usize, shared_memory_bytes: usize) -> Result<usize> {
        let key = (entry.to_string(), threads, shared_memory_bytes);
        if let Backend::Cuda { occupancy, .. } = &self.backend
            && let Some(&blocks) = occupancy.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key)
        {
            return Ok(blocks);
        }
        let function = self.function(entry)?;
        // The occupancy calculator counts only what the kernel may use: opt it in first, as a
        // launch does.
        if shared_memory_bytes > 48 * 1024 {
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_memory_bytes as i32,
                )
                .during(format!("raising the shared-memory limit of {entry}"))?;
        }
        let blocks = function
            .occupancy_max_active_blocks_per_multiprocessor(threads as u32, shared_memory_bytes, None)
            .during(format!("reading the occupancy of {entry}"))?;
        if let Backend::Cuda { occupancy, .. } = &self.backend {
            occupancy.lock().unwrap_or_else(std::sync::PoisonError::into_inner).insert(key, blocks as usize);
        }
        Ok(blocks as usize)
    }

    fn function(&self, entry: &str) -> Result<CudaFunction> {
        match &self.backend {
            Backend::Cuda { modules, .. } => modules.function(entry, &self.info.name),
            Backend::Emulated => Err(Error::NotOnEmulator("information about a compiled kernel")),
        }
    }

    /// Checks that `tensor` was made by this context.
    pub(crate) fn check_owner<T: Scalar>(&self, name: &'static str, tensor: &DeviceTensor<T>) -> Result<()> {
        if tensor.owner() == self.id {
            Ok(())
        } else {
            Err(Error::ForeignTensor { tensor: name, context: self.info.name.clone() })
        }
    }

    /// Launches `entry` with `args` pushed in order, and checks that the launch was accepted.
    /// Kernels that ask for more than the default 48 KiB of dynamic shared memory are opted in
    /// first. On a GPU, errors inside the kernel surface at the next synchronisation; on the
    /// emulator the launch runs to completion and returns them.
    pub(crate) fn launch(&self, entry: &str, config: LaunchConfig, args: &[&dyn KernelArg]) -> Result<()> {
        if let Backend::Emulated = self.backend {
            return self.launch_emulated(entry, config, args);
        }
        let Backend::Cuda { stream, .. } = &self.backend else { unreachable!("handled above") };
        let function = self.function(entry)?;
        if config.shared_mem_bytes > 48 * 1024 {
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    config.shared_mem_bytes as i32,
                )
                .during(format!("raising the shared-memory limit of {entry}"))?;
        }
        let mut builder = stream.launch_builder(&function);
        for arg in args {
            arg.push(&mut builder)?;
        }
        // SAFETY: every caller passes the arguments in the order and types of the kernel's
        // signature (see `ops/`), with buffers whose sizes it checked against the shape.
        unsafe { builder.launch(config) }.during(format!("launching {entry}"))?;
        Ok(())
    }

    fn launch_emulated(&self, entry: &str, config: LaunchConfig, args: &[&dyn KernelArg]) -> Result<()> {
        let kernel = kernels::emulated(entry).ok_or(Error::NotOnEmulator("this kernel"))?;
        let args: Vec<Arg> = args.iter().map(|a| a.emulated()).collect::<Result<_>>()?;
        let (x, y, z) = config.grid_dim;
        let launch = Launch::new(
            (x as usize, y as usize, z as usize),
            config.block_dim.0 as usize,
            config.shared_mem_bytes as usize,
        );
        // SAFETY: as for the GPU launch: the arguments match the kernel's signature and every
        // pointer is a live host buffer of the size the shapes say.
        unsafe { attn_kernels::emu::launch(kernel, launch, &args) }.map_err(|e| Error::Emulated(Box::new(e)))
    }

    // The tensors: made here, so that the tensor module does not know the context.

    /// Copies host data of the given shape to a new device tensor.
    ///
    /// # Errors
    /// [`Error::Length`] when `values.len()` is not the product of `shape`; [`Error::Driver`]
    /// when the allocation fails (e.g. out of device memory).
    pub fn upload<T: Scalar>(&self, values: &[T], shape: &[usize]) -> Result<DeviceTensor<T>> {
        let expected = element_count(shape)?;
        if values.len() != expected {
            return Err(Error::Length { expected, got: values.len() });
        }
        let storage = match self.cuda_stream() {
            // An empty tensor holds no memory (CUDA allocates no zero-byte buffer); see `Storage`.
            _ if expected == 0 => Storage::empty(),
            Some(stream) => Storage::Cuda(stream.clone_htod(values).during("allocating and filling a device tensor")?),
            None => Storage::Host(HostBuffer::new(values.to_vec())),
        };
        Ok(DeviceTensor::from_storage(storage, shape, self.id()))
    }

    /// A new device tensor with every element set to `value`: zeros, or NaN to poison an output
    /// so that any element a kernel fails to write shows up.
    pub fn full<T: Scalar>(&self, shape: &[usize], value: T) -> Result<DeviceTensor<T>> {
        let n = element_count(shape)?;
        self.upload(&vec![value; n], shape)
    }

    /// A tensor of `shape` over `slice`, device memory the caller allocated with cudarc on this
    /// context's CUDA context (on any of its streams: cudarc orders the slice's uses across
    /// streams; another `CudaContext` object of the same device's primary context counts as the
    /// same context). The tensor owns the slice from then on; [`DeviceTensor::into_cuda_slice`] gives
    /// it back. Row-major, as every tensor here.
    ///
    /// # Errors
    /// [`Error::Length`] when `slice` does not hold `shape`'s elements; [`Error::Shape`] on the
    /// emulator, or for a slice of another CUDA context (another device).
    pub fn tensor_from_cuda_slice<T: Scalar>(&self, slice: CudaSlice<T>, shape: &[usize]) -> Result<DeviceTensor<T>> {
        let n = element_count(shape)?;
        let Backend::Cuda { cuda, .. } = &self.backend else {
            return Err(Error::Shape("a CUDA buffer was given to the CPU emulator".into()));
        };
        if slice.context().cu_ctx() != cuda.cu_ctx() {
            return Err(Error::Shape(format!(
                "the buffer belongs to another CUDA context (device {}) than this context's (device {})",
                slice.context().ordinal(),
                self.info.ordinal
            )));
        }
        if slice.len() != n {
            return Err(Error::Length { expected: n, got: slice.len() });
        }
        Ok(DeviceTensor::from_storage(Storage::Cuda(slice), shape, self.id()))
    }

    /// A tensor of `shape` over memory someone else owns and keeps (a PyTorch tensor's
    /// `data_ptr()`, another library's buffer), which it reads and writes in place and never
    /// frees: row-major and contiguous, `address` 16-byte aligned (the kernels copy rows 16 bytes
    /// at a time, and TMA needs it). On a GPU `address` is device memory of this context's
    /// device; on the emulator, host memory.
    ///
    /// # Safety
    /// `address` holds `shape`'s elements of `T`, stays allocated while the tensor lives, and is
    /// not used meanwhile by anyone else except in stream order with this context's stream
    /// (nothing here synchronises with other streams).
    ///
    /// # Errors
    /// [`Error::Shape`] for a null or misaligned address, or a shape whose size overflows.
    pub unsafe fn tensor_from_raw_parts<T: Scalar>(&self, address: u64, shape: &[usize]) -> Result<DeviceTensor<T>> {
        let n = element_count(shape)?;
        n.checked_mul(size_of::<T>())
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or_else(|| Error::Shape(format!("{shape:?} has more bytes than fit in memory")))?;
        if n == 0 {
            // Nothing to read or write (an empty framework tensor's address may be anything).
            return Ok(DeviceTensor::from_storage(Storage::empty(), shape, self.id()));
        }
        if address == 0 || !address.is_multiple_of(16) {
            return Err(Error::Shape(format!(
                "a tensor at address {address:#x} is not 16-byte aligned (copy it to a fresh buffer first)"
            )));
        }
        let storage = match &self.backend {
            // SAFETY: the caller's contract; the tensor is borrowed, so the slice is leaked, never freed.
            Backend::Cuda { stream, .. } => Storage::Cuda(unsafe { stream.upgrade_device_ptr::<T>(address, n) }),
            Backend::Emulated => {
                let ptr = std::ptr::NonNull::new(address as *mut T).expect("checked non-null");
                Storage::Host(HostBuffer::borrowed(ptr, n))
            }
        };
        Ok(DeviceTensor::from_borrowed_storage(storage, shape, self.id()))
    }

    /// A new device tensor whose contents are unspecified; for outputs a kernel overwrites whole.
    pub(crate) fn alloc_output<T: Scalar>(&self, shape: &[usize]) -> Result<DeviceTensor<T>> {
        let n = element_count(shape)?;
        let storage = match self.cuda_stream() {
            _ if n == 0 => Storage::empty(),
            // SAFETY: the element types have no invalid bit patterns, and callers overwrite every
            // element before it is read.
            Some(stream) => {
                Storage::Cuda(unsafe { stream.alloc::<T>(n) }.during(format!("allocating a {shape:?} tensor"))?)
            }
            // The emulator's "uninitialised" memory is NaN, so an unwritten element shows.
            None => Storage::Host(HostBuffer::new(vec![T::POISON; n])),
        };
        Ok(DeviceTensor::from_storage(storage, shape, self.id()))
    }

    /// Sets every element of `tensor` to zero (queued on the stream on a GPU).
    pub(crate) fn fill_zeros<T: Scalar>(&self, tensor: &mut DeviceTensor<T>) -> Result<()> {
        match (tensor.storage_mut(), self.cuda_stream()) {
            (Storage::Cuda(data), Some(stream)) => stream.memset_zeros(data).during("zeroing a tensor"),
            (Storage::Host(data), _) => {
                data.as_mut_slice().fill(T::default());
                Ok(())
            }
            (Storage::Cuda(_), None) => Err(Error::Shape("a GPU tensor was given to the CPU emulator".into())),
        }
    }

    // The kernel path.

    /// The architecture of the modules this context takes its portable (non-Hopper) kernels
    /// from, as kernel labels name it: `sm_80`, or `sm_75` on a Turing GPU (or a GPU context
    /// under the `t4` profile), which runs Turing's copies of the same kernels.
    pub fn portable_modules(&self) -> &'static str {
        if self.info.runs_turing_modules() { "sm_75" } else { "sm_80" }
    }

    /// Whether this context runs the `sm_90a` kernels: a GPU of compute capability 9.0 (their
    /// module loads on first use).
    pub fn has_hopper_kernels(&self) -> bool {
        match &self.backend {
            Backend::Cuda { modules, .. } => kernels::MODULE_ARCHS
                .iter()
                .zip(&modules.runnable)
                .any(|(&arch, &runnable)| arch == "sm_90a" && runnable),
            Backend::Emulated => false,
        }
    }

    /// `Ok` if this context's kernels take `dtype` ([`DeviceInfo::supports`]); every entry point
    /// asks before it runs or writes anything.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for `bf16` on Turing.
    pub(crate) fn require_dtype(&self, dtype: DType) -> Result<()> {
        if self.info.supports(dtype) {
            Ok(())
        } else {
            Err(Error::Unsupported { what: BF16_ON_TURING, device: self.info.name.clone() })
        }
    }

    /// `Ok` if this context runs the sm_90a kernels.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the device otherwise.
    pub(crate) fn require_hopper_kernels(&self) -> Result<()> {
        if self.has_hopper_kernels() {
            Ok(())
        } else {
            Err(Error::Unsupported { what: "the sm_90a kernels (wgmma, TMA)", device: self.device().name.clone() })
        }
    }

    /// The kernel path of this context (see [`KernelPath`]).
    pub fn kernel_path(&self) -> KernelPath {
        self.kernel_path
    }

    /// This context on kernel path `path`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for [`KernelPath::Sm90a`] on a context without the sm_90a kernels
    /// (another GPU, or the CPU emulator).
    pub fn with_kernel_path(mut self, path: KernelPath) -> Result<Self> {
        if path == KernelPath::Sm90a {
            self.require_hopper_kernels()?;
        }
        self.kernel_path = path;
        Ok(self)
    }

    /// This context with a lower grid limit (at most CUDA's 65,535 blocks in y and z), so that a
    /// test can run the chunked path of a problem with more heads or batch entries than that on
    /// small shapes. Not for other uses.
    #[doc(hidden)]
    pub fn with_grid_limit(mut self, limit: usize) -> Self {
        self.grid_limit = limit.clamp(1, crate::problem::MAX_GRID_YZ);
        self
    }

    /// What the selection policy reads about this context: its kernel path and device.
    pub(crate) fn target(&self) -> Target<'_> {
        Target { path: self.kernel_path, device: &self.info }
    }

    // Tensor maps (TMA).

    /// Copies tensor maps back to back into one device buffer, the Hopper kernels' first argument
    /// (they are read by TMA, from global memory).
    pub(crate) fn upload_tensor_maps(&self, maps: &[CUtensorMap]) -> Result<TensorMaps> {
        let Backend::Cuda { stream, tensor_maps, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("tensor maps (TMA)"));
        };
        let words: Vec<u64> = maps.iter().flat_map(|map| map.opaque).collect();
        Ok(TensorMaps { maps: tensor_maps.get(stream, &words)? })
    }

    /// Encodes a tensor map of `tensor` with `cuTensorMapEncodeTiled`: `dims` and
    /// `box_dims` innermost first, `strides` in bytes for every dimension but the innermost.
    pub(crate) fn encode_tensor_map<T: Element>(
        &self,
        tensor: &DeviceTensor<T>,
        dims: &[u64],
        strides: &[u64],
        box_dims: &[u32],
        swizzle: CUtensorMapSwizzle,
    ) -> Result<CUtensorMap> {
        let Backend::Cuda { stream, .. } = &self.backend else {
            return Err(Error::NotOnEmulator("tensor maps (TMA)"));
        };
        let data_type = match T::DTYPE {
            DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DType::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F32 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        };
        let rank = dims.len();
        debug_assert!(box_dims.len() == rank && strides.len() + 1 == rank);
        let slice = tensor.cuda_slice().expect("a GPU tensor on a GPU context");
        let (address, _guard) = cudarc::driver::DevicePtr::device_ptr(slice, stream);
        let element_strides = vec![1u32; rank];
        let mut map = CUtensorMap { opaque: [0; 16] };
        // SAFETY: every pointer refers to a live local array of the length `rank` implies (the
        // strides one shorter); the address is the tensor's device allocation.
        unsafe {
            cudarc::driver::sys::cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                rank as u32,
                address as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()
        }
        .during("encoding a tensor map (cuTensorMapEncodeTiled)")?;
        Ok(map)
    }
}

/// Reads a 64-bit attribute of a memory pool, or writes `value` to it (and returns it).
fn pool_attribute(
    pool: cudarc::driver::sys::CUmemoryPool,
    attribute: cudarc::driver::sys::CUmemPool_attribute,
    value: Option<u64>,
) -> Result<u64> {
    use cudarc::driver::result::mem_pool;
    let mut data = value.unwrap_or(0);
    let ptr = (&mut data as *mut u64).cast();
    // SAFETY: `pool` is the device's default pool; the usage attributes are `cuuint64_t`.
    let result = unsafe {
        if value.is_some() {
            mem_pool::set_attribute(pool, attribute, ptr)
        } else {
            mem_pool::get_attribute(pool, attribute, ptr)
        }
    };
    result.during("accessing the memory pool's usage counters")?;
    Ok(data)
}

/// Whether libcuda can be used. With cudarc's `dynamic-loading` (this crate's feature of that
/// name) it is opened at run time, so a machine without a driver must be told apart before the
/// first call (cudarc would panic on it); with `dynamic-linking` or `static-linking`, the final
/// crate's choice, the program would not have started without it.
fn driver_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: only tries to open the library; no CUDA call is made.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }
    #[cfg(not(feature = "dynamic-loading"))]
    {
        true
    }
}
