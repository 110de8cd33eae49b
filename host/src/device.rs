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

impl DeviceInfo {
    /// Whether this GPU runs Turing's `sm_75` modules rather than the `sm_80` ones: compute
    /// capability below 8.0 (a Turing GPU, or a GPU context under the `t4` [`GpuProfile`]).
    pub fn runs_turing_modules(&self) -> bool {
        self.compute_capability < (8, 0)
    }

    /// Whether the device's kernels take `dtype`: every type from Ampere on (compute capability
    /// 8.0); on Turing (7.5) `f32` and `f16` only, as its tensor cores have no `bf16` products
    /// (a `bf16` call there is an [`Error::Unsupported`](crate::Error::Unsupported) before
    /// anything runs).
    pub fn supports(&self, dtype: crate::DType) -> bool {
        dtype != crate::DType::Bf16 || !self.runs_turing_modules()
    }
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

/// A smaller GPU's limits, imposed on a bigger one: so that an H200 runs what an RTX 4090 or an
/// A100 would (the tiles that fit its shared memory, the sm_80 kernels only), and the tests, the
/// main job and the benches can be checked for those GPUs on the one machine there is
/// ([`GpuProfile::ENV`]; [`GpuProfile::apply`]). A profile limits; it does not make the device
/// slower or smaller in any other way (SM count, memory, clocks and L2 stay the device's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuProfile {
    /// The name `RUST_ATTENTION_GPU_PROFILE` takes: `rtx3090`, `rtx4090`, `l4`, `a100`, `t4`.
    pub name: &'static str,
    /// The GPU it stands for.
    pub gpu: &'static str,
    /// Its compute capability: below 9.0 the sm_90a kernels are hidden; below 8.0 (Turing) a GPU
    /// context runs the sm_75 modules, as on the real GPU, and refuses `bf16` (the emulator runs
    /// the sm_80 kernels' source under every profile).
    pub compute_capability: (i32, i32),
    /// Its largest dynamic shared memory per block (opt-in), in bytes.
    pub max_shared_memory_per_block: usize,
}

impl GpuProfile {
    /// The environment variable that puts every new context (GPU or emulator) under a profile:
    /// one of the [`GpuProfile::ALL`] names.
    pub const ENV: &'static str = "RUST_ATTENTION_GPU_PROFILE";

    /// The named profiles (shared memory per block from NVIDIA's tuning guides: 99 KiB on
    /// compute capability 8.6 and 8.9, 163 KiB on 8.0, 64 KiB on 7.5).
    pub const ALL: [Self; 5] = [
        Self::new("rtx3090", "GeForce RTX 3090", (8, 6), 99 * 1024),
        Self::new("rtx4090", "GeForce RTX 4090", (8, 9), 99 * 1024),
        Self::new("l4", "L4", (8, 9), 99 * 1024),
        Self::new("a100", "A100", (8, 0), 163 * 1024),
        Self::new("t4", "T4", (7, 5), 64 * 1024),
    ];

    const fn new(name: &'static str, gpu: &'static str, compute_capability: (i32, i32), smem: usize) -> Self {
        Self { name, gpu, compute_capability, max_shared_memory_per_block: smem }
    }

    /// The profile [`GpuProfile::ENV`] names, if it is set and not empty (empty: none).
    ///
    /// # Errors
    /// A message listing the names, for a value that is none of them.
    pub fn from_env() -> Result<Option<Self>, String> {
        match std::env::var(Self::ENV) {
            Ok(name) if name.is_empty() => Ok(None),
            Ok(name) => name.parse().map(Some),
            Err(_) => Ok(None),
        }
    }

    /// `info` under this profile: the smaller of the two shared-memory limits, the profile's
    /// compute capability, and a name that says both ("NVIDIA H200 as A100").
    pub fn apply(&self, info: &DeviceInfo) -> DeviceInfo {
        DeviceInfo {
            name: format!("{} as {}", info.name, self.gpu),
            compute_capability: self.compute_capability,
            max_shared_memory_per_block: info.max_shared_memory_per_block.min(self.max_shared_memory_per_block),
            ..info.clone()
        }
    }
}

impl std::str::FromStr for GpuProfile {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|p| p.name == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|p| p.name).collect();
            format!("unknown GPU profile {s:?}; use one of {}", names.join(", "))
        })
    }
}
