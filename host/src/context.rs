//! The CUDA context: one device, one stream, the embedded PTX module loaded once.

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::error::{During, Error, Result};
use crate::kernels;
use crate::tensor::DeviceTensor;

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

/// A CUDA device with the kernels of this crate loaded, and the stream every operation runs on.
///
/// Creating one loads the driver library at run time, so programs that use this crate build and
/// start on machines without a GPU; [`Context::new`] then returns [`Error::NoDriver`] or
/// [`Error::NoDevice`]. All operations are queued on one stream and are therefore ordered; reads
/// back to the host ([`DeviceTensor::to_host`]) wait for them.
pub struct Context {
    cuda: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    info: DeviceInfo,
}

/// The oldest compute capability the embedded `sm_80` PTX runs on.
const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

impl Context {
    /// Opens device `ordinal` and loads the kernels (the driver compiles the PTX for the device,
    /// which takes a moment the first time).
    ///
    /// # Errors
    /// [`Error::NoDriver`] without an NVIDIA driver, [`Error::NoDevice`] for a missing ordinal,
    /// [`Error::UnsupportedDevice`] below compute capability 8.0, [`Error::Driver`] otherwise.
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
        let module = cuda.load_module(Ptx::from_src(kernels::PTX_SM_80)).during("loading the kernels' PTX module")?;
        let stream = cuda.new_stream().during("creating a stream")?;
        Ok(Self { cuda, stream, module, info })
    }

    /// The device this context runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every operation of this context is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits until everything queued so far has finished; reports a failed kernel.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().during("waiting for the GPU")
    }

    /// (free, total) device memory in bytes, as the driver reports it now.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.cuda.mem_get_info().during("reading free device memory")
    }

    /// Registers per thread and local (spilled) bytes per thread of a kernel, as the driver
    /// compiled it for this device.
    pub fn kernel_resources(&self, entry: &str) -> Result<(usize, usize)> {
        let function = self.function(entry)?;
        let regs = function.num_regs().during(format!("reading the registers of {entry}"))?;
        let local = function.local_size_bytes().during(format!("reading the local memory of {entry}"))?;
        Ok((regs as usize, local as usize))
    }

    pub(crate) fn function(&self, entry: &str) -> Result<CudaFunction> {
        self.module.load_function(entry).during(format!("looking up kernel {entry}"))
    }

    /// Checks that `tensor` was made by this context.
    pub(crate) fn check_owner(&self, name: &'static str, tensor: &DeviceTensor) -> Result<()> {
        let tensor_ctx = tensor.data().context();
        if Arc::ptr_eq(tensor_ctx, &self.cuda) {
            Ok(())
        } else {
            Err(Error::ForeignTensor {
                tensor: name,
                tensor_device: tensor_ctx.ordinal(),
                context_device: self.info.ordinal,
            })
        }
    }

    /// Launches `entry` with `args` pushed in order, and checks that the launch was accepted.
    /// Kernels that ask for more than the default 48 KiB of dynamic shared memory are opted in
    /// first. Errors inside the kernel surface at the next synchronisation.
    pub(crate) fn launch(&self, entry: &str, config: LaunchConfig, args: &[&dyn KernelArg]) -> Result<()> {
        let function = self.function(entry)?;
        if config.shared_mem_bytes > 48 * 1024 {
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    config.shared_mem_bytes as i32,
                )
                .during(format!("raising the shared-memory limit of {entry}"))?;
        }
        let mut builder = self.stream.launch_builder(&function);
        for arg in args {
            arg.push(&mut builder);
        }
        // SAFETY: every caller passes the arguments in the order and types of the kernel's
        // signature (see `ops.rs`), with buffers whose sizes it checked against the shape.
        unsafe { builder.launch(config) }.during(format!("launching {entry}"))?;
        Ok(())
    }
}

/// A value that can be passed to a kernel: a device buffer (its address) or a scalar.
pub(crate) trait KernelArg {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>);
}

macro_rules! scalar_kernel_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) {
                builder.arg(self);
            }
        }
    )*};
}
scalar_kernel_arg!(f32, usize, isize);

impl KernelArg for cudarc::driver::CudaSlice<f32> {
    fn push<'a>(&'a self, builder: &mut cudarc::driver::LaunchArgs<'a>) {
        builder.arg(self);
    }
}
