//! **Base layer.** What a device is, as plain data: where a context runs ([`Device`]) and the
//! facts about a GPU that decide what can be launched on it ([`DeviceInfo`]). The kernel choice
//! ([`crate::select`]) and the tile checks ([`crate::kernels`]) read these facts without a
//! [`Context`](crate::Context), which opens the device ([`crate::runtime`]).

/// Where a [`Context`](crate::Context) runs kernels.
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
