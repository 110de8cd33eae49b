//! The context: a CUDA device with one stream and the embedded PTX module loaded once, or the CPU
//! emulator running the same kernels' source on the host.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use attn_kernels::emu::{Arg, Launch};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::dtype::{DType, Element};
use crate::error::{During, Error, Result};
use crate::hopper::KernelPath;
use crate::kernels;
use crate::tensor::{DeviceTensor, Storage};

/// Where a [`Context`] runs kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CUDA device with this ordinal.
    Gpu(usize),
    /// The CPU emulator (`attn_kernels::emu`): the same kernel source run with one OS thread per
    /// GPU thread, checking shared-memory bounds, races and barriers. Slow by design: for
    /// testing, learning and debugging on machines without a GPU, not for timing.
    CpuEmulated,
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `0`, `1`, … for a GPU ordinal, or `cpu-emulated`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu-emulated" => Ok(Self::CpuEmulated),
            _ => s
                .parse()
                .map(Self::Gpu)
                .map_err(|_| format!("`{s}` is neither a GPU ordinal (0, 1, …) nor `cpu-emulated`")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Gpu(ordinal) => write!(f, "GPU {ordinal}"),
            Self::CpuEmulated => f.write_str("CPU emulator"),
        }
    }
}

/// Facts about the device that decide what can be launched on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal, as in `CUDA_VISIBLE_DEVICES` order.
    pub ordinal: usize,
    /// Marketing name, e.g. "NVIDIA H200".
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Largest dynamic shared memory one block may ask for, in bytes, once the kernel opts in
    /// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`; 227 KiB on Hopper).
    pub max_shared_memory_per_block: usize,
    /// Device memory, in bytes.
    pub total_memory: usize,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "{} (device {}, compute capability {major}.{minor}, {} SMs, {} KiB shared memory per block, {:.1} GiB)",
            self.name,
            self.ordinal,
            self.sm_count,
            self.max_shared_memory_per_block / 1024,
            self.total_memory as f64 / (1u64 << 30) as f64
        )
    }
}

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
}

pub(crate) enum Backend {
    /// `modules[kernels::module_of(entry)]` holds kernel `entry`; `None` for a module this GPU
    /// cannot run (the sm_90a one off Hopper).
    Cuda {
        cuda: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        modules: Vec<Option<Arc<CudaModule>>>,
        /// The Hopper kernels' tensor maps already in device memory, by content
        /// ([`crate::hopper::TensorMapCache`]).
        tensor_maps: crate::hopper::TensorMapCache,
    },
    Emulated,
}

fn next_context_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The oldest compute capability the embedded `sm_80` PTX runs on.
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

impl Context {
    /// Opens device `ordinal` and loads the kernels (the driver compiles the PTX for the device,
    /// which takes a moment the first time).
    ///
    /// # Errors
    /// [`Error::NoDriver`] without an NVIDIA driver, [`Error::NoDevice`] for a missing ordinal,
    /// [`Error::UnsupportedDevice`] below compute capability 8.0, [`Error::Argument`] for an
    /// unknown value of [`KernelPath::ENV`], [`Error::Unsupported`] when it asks for `sm90a` off
    /// Hopper, [`Error::Driver`] otherwise.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: only tries to open the library; no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        let count = CudaContext::device_count().during("counting CUDA devices")?.max(0) as usize;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let cuda = CudaContext::new(ordinal).during(format!("creating a context on device {ordinal}"))?;
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
        if info.compute_capability < MIN_COMPUTE_CAPABILITY {
            let (major, minor) = info.compute_capability;
            return Err(Error::UnsupportedDevice { name: info.name, major, minor, needed: "8.0 (Ampere)" });
        }
        // The sm_80 modules run on every supported GPU; the sm_90a one (Hopper's `wgmma` and
        // TMA) only on compute capability 9.0, so elsewhere it is not loaded.
        let hopper = info.compute_capability == (9, 0);
        let modules = kernels::PTX
            .iter()
            .zip(kernels::MODULES.iter().zip(kernels::MODULE_ARCHS))
            .map(|(ptx, (group, arch))| match *arch {
                "sm_90a" if !hopper => Ok(None),
                _ => cuda
                    .load_module(Ptx::from_src(*ptx))
                    .map(Some)
                    .during(format!("loading the kernels' PTX module ({group}, {arch})")),
            })
            .collect::<Result<Vec<_>>>()?;
        let stream = cuda.new_stream().during("creating a stream")?;
        let preferred = if hopper { KernelPath::Sm90a } else { KernelPath::Sm80 };
        let context = Self {
            id: next_context_id(),
            backend: Backend::Cuda { cuda, stream, modules, tensor_maps: Default::default() },
            info,
            kernel_path: KernelPath::Sm80,
        };
        context.with_kernel_path(KernelPath::from_env()?.unwrap_or(preferred))
    }

    /// The CPU emulator: the kernels' own source, run on the host with one OS thread per GPU
    /// thread (see [`Device::CpuEmulated`]). It needs no GPU and never fails to open. It reports
    /// itself as a device with one SM, so that grid-stride kernels launch few blocks, and with a
    /// Hopper's 227 KiB of shared memory per block, so that every compiled tile runs.
    pub fn cpu_emulated() -> Self {
        let info = DeviceInfo {
            ordinal: 0,
            name: "CPU emulator".into(),
            compute_capability: MIN_COMPUTE_CAPABILITY,
            sm_count: 1,
            max_shared_memory_per_block: 227 * 1024,
            total_memory: 0,
        };
        Self { id: next_context_id(), backend: Backend::Emulated, info, kernel_path: KernelPath::Sm80 }
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
        Ok(blocks as usize)
    }

    fn function(&self, entry: &str) -> Result<CudaFunction> {
        match &self.backend {
            Backend::Cuda { modules, .. } => {
                let index = kernels::module_of(entry);
                let module = modules[index].as_ref().ok_or_else(|| Error::Unsupported {
                    what: "this kernel's sm_90a module (compute capability 9.0)",
                    device: self.info.name.clone(),
                })?;
                module.load_function(entry).during(format!("looking up kernel {entry}"))
            }
            Backend::Emulated => Err(Error::NotOnEmulator("information about a compiled kernel")),
        }
    }

    /// Checks that `tensor` was made by this context.
    pub(crate) fn check_owner<T: Element>(&self, name: &'static str, tensor: &DeviceTensor<T>) -> Result<()> {
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
        // signature (see `ops.rs`), with buffers whose sizes it checked against the shape.
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

/// A value that can be passed to a kernel: a tensor (its address) or a scalar.
pub(crate) trait KernelArg {
    /// Pushes the value onto a CUDA launch.
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()>;
    /// The value as the emulator passes it.
    fn emulated(&self) -> Result<Arg>;
}

macro_rules! scalar_kernel_arg {
    ($($t:ty => $variant:ident),*) => {$(
        impl KernelArg for $t {
            fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
                builder.arg(self);
                Ok(())
            }

            fn emulated(&self) -> Result<Arg> {
                Ok(Arg::$variant(*self))
            }
        }
    )*};
}
scalar_kernel_arg!(f32 => F32, usize => Usize, isize => Isize);

impl<T: Element> KernelArg for DeviceTensor<T> {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) -> Result<()> {
        match self.storage() {
            Storage::Cuda(data) => {
                builder.arg(data);
                Ok(())
            }
            Storage::Host(_) => Err(Error::Shape("an emulator tensor was passed to a GPU kernel".into())),
        }
    }

    fn emulated(&self) -> Result<Arg> {
        match self.storage() {
            // The emulated kernels take 16-bit tensors as raw bits.
            Storage::Host(data) => Ok(match T::DTYPE {
                DType::F32 => Arg::Ptr(data.as_ptr() as *mut f32),
                DType::F16 | DType::Bf16 => Arg::Ptr16(data.as_ptr() as *mut u16),
            }),
            Storage::Cuda(_) => Err(Error::Shape("a GPU tensor was passed to an emulated kernel".into())),
        }
    }
}
