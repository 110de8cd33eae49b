//! Embeds the PTX modules of the device crate `kernels/` in this crate: compiled from source with
//! the `build-ptx` feature (this workspace turns it on), else the modules shipped in `host/ptx/`.
//!
//! **Shipped** (a crate that depends on attn-host, on any toolchain, stable included): the
//! xz-compressed modules in `host/ptx/` are unpacked into `OUT_DIR`. `scripts/ship-ptx` writes
//! them from a `build-ptx` build, and CI checks that they are what the kernel source compiles to.
//!
//! **From source** (`build-ptx`; the pinned nightly toolchain):
//!
//! 1. `cargo rustc -Zbuild-std=core --target nvptx64-nvidia-cuda --crate-type staticlib` builds
//!    `kernels/` as a static library (panic=abort, one codegen unit), twice and at once: for
//!    `-Ctarget-cpu=sm_80` and for `sm_75` (Turing, where `kernels/src/hw/ptx.rs` picks its
//!    sm_75 instructions by `cfg(target_feature = "sm_80")`). On this target rustc writes LLVM
//!    bitcode, not machine code, into the archive. Each nested cargo gets a target directory of
//!    its own: sharing ours would deadlock on its lock.
//! 2. `llvm-link` joins each build's kernel bitcode with what it uses of `core` and
//!    `compiler_builtins` (`--only-needed --internalize`, so nothing else of them is kept).
//! 3. Per module group ([`MODULE_GROUPS`], several at a time): `opt` keeps the group's kernels
//!    (internalize + globaldce), `opt -O3` with the group's flags, then `llc -mcpu=<arch>` writes
//!    PTX text for the group's architecture (`sm_80` for the portable kernels, `sm_90a` for the
//!    Hopper ones, `sm_75` for Turing's copies of the `f32` and `f16` ones).
//! 4. The PTX modules, and a registry generated from their `.entry` names, are written to
//!    `OUT_DIR/kernels.rs`, which `src/kernels.rs` includes.
//!
//! The tools come from the pinned toolchain's `llvm-tools` component, so the LLVM that reads the
//! bitcode is the one that wrote it. When a piece is missing the build stops with one message
//! that says what to run.

use std::env;
use std::ffi::OsStr;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, exit};

/// The architecture the device crate is compiled for (its bitcode's target CPU). Each module
/// group's PTX is then written for the group's own architecture.
const BASE_ARCH: &str = "sm_80";

/// Turing (compute capability 7.5): the device crate is compiled a second time for it, and its
/// `f32` and `f16` kernels make modules of their own (Turing has no `bf16` tensor cores, no
/// `cp.async`, no `wgmma`).
const TURING_ARCH: &str = "sm_75";

const NVPTX_TARGET: &str = "nvptx64-nvidia-cuda";

/// The PTX ISA version the `sm_80` modules declare: 7.8 (CUDA 11.8) is the first with
/// `movmatrix` (`hw::transpose_b`, which no kernel calls since the backward's profile of issue
/// 27; the version stays so that a kernel may). Drivers from CUDA 11.8 on load it.
const PTX_VERSION: &str = "ptx78";

/// The PTX ISA version of the Hopper module: 8.0 (CUDA 12.0) is the first with `wgmma`,
/// `setmaxnreg`, the bulk tensor copies and reductions, and the `sm_90a` target.
const PTX_VERSION_HOPPER: &str = "ptx80";

/// LLVM's loop-unrolling budget for the device code. The tensor-core kernels hold their tiles in
/// register arrays (`[FragC; N]`) indexed by loop counters: only a fully unrolled loop turns every
/// index into a constant, so that the array lives in registers. At LLVM's default budget the
/// larger tiles' loops stay rolled and their arrays go to local memory (slow, and a pressure on
/// registers once ptxas unrolls them itself).
const UNROLL: &str = "-unroll-threshold=1500";

/// One PTX module: its name, the architecture and PTX version it is written for (its bitcode
/// comes from the device crate's build for that architecture, `sm_80`'s for `sm_90a`), and the
/// extra `opt` flags of its kernels. A module is known by its name and architecture together:
/// the `sm_75` modules repeat the `sm_80` names.
struct ModuleGroup {
    name: &'static str,
    arch: &'static str,
    ptx_version: &'static str,
    opt_flags: Option<&'static str>,
}

impl ModuleGroup {
    /// The architecture of the device crate's build that this module is cut from.
    fn build_arch(&self) -> &'static str {
        if self.arch == TURING_ARCH { TURING_ARCH } else { BASE_ARCH }
    }

    /// Whether kernel `entry` belongs to this module.
    fn holds(&self, entry: &str) -> bool {
        if self.arch == TURING_ARCH { turing_group_of(entry) == Some(self.name) } else { group_of(entry) == self.name }
    }
}

/// The kernels are compiled into nine PTX modules, each optimised with its own flags: the
/// CUDA-core kernels (f32, vector add, naive attention) at LLVM's default unrolling budget, which
/// they were tuned at (more unrolling makes their backward kernels spill), the tensor-core
/// kernels (f16, bf16) with [`UNROLL`], both for `sm_80` (every GPU from Ampere on), each with
/// a module of its own for the flash kernels' band-table twins (`_table`, which only problems
/// with a band table run), and the Hopper kernels (`hopper_*`, `wgmma` and TMA) for `sm_90a`,
/// which only compute capability 9.0 runs. The last four repeat the four `sm_80` modules for
/// `sm_75` (Turing) from the crate's Turing build, without the `bf16` kernels. The host loads a kernel
/// from its module the first time it looks it up, by name (the driver compiles it then).
const MODULE_GROUPS: &[ModuleGroup] = &[
    ModuleGroup { name: "cuda_cores", arch: BASE_ARCH, ptx_version: PTX_VERSION, opt_flags: None },
    ModuleGroup { name: "tensor_cores", arch: BASE_ARCH, ptx_version: PTX_VERSION, opt_flags: Some(UNROLL) },
    ModuleGroup { name: "hopper", arch: "sm_90a", ptx_version: PTX_VERSION_HOPPER, opt_flags: Some(UNROLL) },
    ModuleGroup { name: "cuda_cores_tables", arch: BASE_ARCH, ptx_version: PTX_VERSION, opt_flags: None },
    ModuleGroup { name: "tensor_cores_tables", arch: BASE_ARCH, ptx_version: PTX_VERSION, opt_flags: Some(UNROLL) },
    ModuleGroup { name: "cuda_cores", arch: TURING_ARCH, ptx_version: PTX_VERSION, opt_flags: None },
    ModuleGroup { name: "tensor_cores", arch: TURING_ARCH, ptx_version: PTX_VERSION, opt_flags: Some(UNROLL) },
    ModuleGroup { name: "cuda_cores_tables", arch: TURING_ARCH, ptx_version: PTX_VERSION, opt_flags: None },
    ModuleGroup { name: "tensor_cores_tables", arch: TURING_ARCH, ptx_version: PTX_VERSION, opt_flags: Some(UNROLL) },
];

/// The module group of kernel `entry`. The host's registry (`module_of`) is generated from the
/// modules' entry lists, not from this rule.
fn group_of(entry: &str) -> &'static str {
    let twin = entry.ends_with(TABLE_TWIN);
    if entry.starts_with("hopper_") {
        "hopper"
    } else if entry.contains("_f16") || entry.contains("_bf16") {
        if twin { "tensor_cores_tables" } else { "tensor_cores" }
    } else if twin {
        "cuda_cores_tables"
    } else {
        "cuda_cores"
    }
}

/// The `sm_75` module group of kernel `entry`: its `sm_80` group, for every kernel that Turing
/// runs (not the Hopper ones, not the `bf16` ones).
fn turing_group_of(entry: &str) -> Option<&'static str> {
    let group = group_of(entry);
    (group != "hopper" && !entry.contains("_bf16")).then_some(group)
}

const KERNEL_CRATE: &str = "attn_kernels";
const FIX: &str = "run `rustup toolchain install` in the repository root (it installs the pinned \
                   nightly with the rust-src and llvm-tools components); a crate that depends on \
                   attn-host with its `build-ptx` feature needs the same toolchain: copy the \
                   repository's rust-toolchain.toml next to its Cargo.toml (without `build-ptx`, \
                   attn-host takes the PTX shipped in host/ptx/ and builds on stable Rust)";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels_dir = manifest_dir.parent().unwrap().join("kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let modules = if env::var_os("CARGO_FEATURE_BUILD_PTX").is_some() {
        println!("cargo::rerun-if-changed={}", kernels_dir.join("src").display());
        println!("cargo::rerun-if-changed={}", kernels_dir.join("Cargo.toml").display());
        println!("cargo::rerun-if-changed={}", manifest_dir.parent().unwrap().join("rust-toolchain.toml").display());
        let modules = build_ptx(&kernels_dir, &out_dir, &LlvmTools::find());
        check_launch_bounds(&modules);
        modules
    } else {
        println!("cargo::rerun-if-changed={}", manifest_dir.join(SHIPPED_DIR).display());
        shipped_ptx(&manifest_dir.join(SHIPPED_DIR))
    };

    let mut generated = String::from("// @generated by host/build.rs from the kernels/ crate.\n\n");
    // `match` arms of `module_of`: the entries of every module but the first, which is the
    // default; of `turing_module_of`: the entries of the sm_75 modules.
    let mut module_arms = String::new();
    let mut turing_arms = String::new();
    for (index, (group, ptx)) in modules.iter().enumerate().skip(1) {
        let names: Vec<String> = ptx_entries(ptx).iter().map(|name| format!("{name:?}")).collect();
        if names.is_empty() {
            continue;
        }
        let names = names.join(" | ");
        if group.arch == TURING_ARCH {
            writeln!(turing_arms, "        {names} => Some({index}),").unwrap();
        } else {
            writeln!(module_arms, "        {names} => {index},").unwrap();
        }
    }
    check_turing_modules(&modules);
    // The kernels, by name: the sm_75 modules hold copies of sm_80 ones.
    let mut entries: Vec<String> =
        modules.iter().filter(|(group, _)| group.arch != TURING_ARCH).flat_map(|(_, ptx)| ptx_entries(ptx)).collect();
    entries.sort();
    writeln!(generated, "/// PTX of the `kernels/` crate, one module per group of kernels ([`MODULES`]).").unwrap();
    writeln!(generated, "pub const PTX: &[&str] = &[").unwrap();
    for (group, ptx) in &modules {
        let ptx_path = out_dir.join(module_file(group));
        fs::write(&ptx_path, ptx).unwrap();
        writeln!(generated, "    include_str!({:?}),", ptx_path.display()).unwrap();
    }
    writeln!(generated, "];\n").unwrap();
    let groups: Vec<String> = MODULE_GROUPS.iter().map(|g| format!("{:?}", g.name)).collect();
    let archs: Vec<String> = MODULE_GROUPS.iter().map(|g| format!("{:?}", g.arch)).collect();
    writeln!(
        generated,
        "/// The module groups, in the order of [`PTX`] (a name and its [`MODULE_ARCHS`] entry name a module).\n\
         pub const MODULES: &[&str] = &[{}];\n\n\
         /// The architecture each module is written for (`sm_90a` runs on compute capability 9.0 only; \
         `sm_75` is Turing's copy of the `sm_80` modules that have no `bf16`).\n\
         pub const MODULE_ARCHS: &[&str] = &[{}];\n\n\
         /// The index of the `sm_80` or `sm_90a` module that holds the kernel `entry` (0 for a name of no module).\n\
         pub fn module_of(entry: &str) -> usize {{\n    match entry {{\n{module_arms}        _ => 0,\n    }}\n}}\n\n\
         /// The index of the `sm_75` (Turing) module that holds the kernel `entry`, if one does: \
         every kernel of the `sm_80` modules but the `bf16` ones.\n\
         pub fn turing_module_of(entry: &str) -> Option<usize> {{\n    match entry {{\n{turing_arms}        _ => None,\n    }}\n}}\n",
        groups.join(", "),
        archs.join(", ")
    )
    .unwrap();
    generated.push_str(&registry_source(&entries));
    fs::write(out_dir.join("kernels.rs"), generated).unwrap();
}

/// Families of FlashAttention kernels: the entry-name prefix and the `FlashKernel` variant of each.
/// Their instances are named `{prefix}_{dtype}_m{block_m}_n{block_n}_d{head_dim}`, with a
/// `_s{stages}` suffix for the tensor-core kernels (which have a copy pipeline). The Hopper
/// kernels are named the same way behind a `hopper_` prefix (`hopper_flash_fwd_…`,
/// `hopper_flash_bwd_…`), the forward ones with a `_pingpong` suffix when their consumer
/// warpgroups take turns. A tensor-core instance with a `_padded` suffix also runs head dims
/// below its own (`layout::row_length`); the `f32` and Hopper instances all do.
const FLASH_FAMILIES: &[(&str, &str)] = &[
    ("flash_fwd", "Forward"),
    ("flash_bwd", "Backward"),
    ("flash_bwd_dkdv", "BackwardDkDv"),
    ("flash_bwd_dq", "BackwardDq"),
];

/// The suffix of a flash kernel's band-table twin.
const TABLE_TWIN: &str = configs::TABLE_TWIN_SUFFIX;

/// Element types in kernel names and their `DType` variants.
const DTYPES: &[(&str, &str)] = &[("f32", "F32"), ("f16", "F16"), ("bf16", "Bf16")];

/// Rust source for the kernel registry: a constant per plain kernel, and the tables of
/// FlashAttention instances (sm_80 and Hopper) parsed from their systematic names.
fn registry_source(entries: &[String]) -> String {
    let mut plain = String::new();
    let mut all = Vec::new();
    let mut flash = String::new();
    let mut hopper = String::new();
    let mut decoders = Vec::new();
    for name in entries {
        // A flash kernel's `_table` twin (the entry for problems with a band table,
        // `attention_kernel!`) is not an instance of its own: the host derives its name from
        // the plain one's (`ProblemArgs::entry`). It is in the emulator's list below.
        if let Some(plain) = name.strip_suffix(TABLE_TWIN) {
            if flash_instance(plain).is_none_or(|f| f.hopper) {
                fail(&format!("kernel {name} ends in {TABLE_TWIN} but is no sm_80 flash kernel's twin"));
            }
            continue;
        }
        if let Some(decoder) = decoder_instance(name) {
            decoders.push(decoder);
            continue;
        }
        match flash_instance(name) {
            Some(FlashName { variant, dtype, block_m, block_n, head_dim, stages, hopper: false, padded, .. }) => {
                writeln!(
                    flash,
                    "    FlashInstance {{ kernel: FlashKernel::{variant}, dtype: DType::{dtype}, block_m: {block_m}, \
                 block_n: {block_n}, head_dim: {head_dim}, stages: {stages}, padded: {padded}, entry: {name:?} }},"
                )
                .unwrap()
            }
            Some(FlashName {
                variant,
                dtype,
                block_m,
                block_n,
                head_dim,
                stages,
                hopper: true,
                hopper_variant,
                ..
            }) => {
                // The blocks per SM its launch bounds promise (ptxas keeps the registers to that).
                let blocks_per_sm = configs::launch_bounds(name).map_or(1, |b| b.1);
                writeln!(
                    hopper,
                    "    HopperInstance {{ kernel: FlashKernel::{variant}, dtype: DType::{dtype}, block_m: {block_m}, \
                 block_n: {block_n}, head_dim: {head_dim}, stages: {stages}, variant: HopperVariant::{hopper_variant}, \
                 blocks_per_sm: {blocks_per_sm}, entry: {name:?} }},"
                )
                .unwrap()
            }
            None => {
                writeln!(
                    plain,
                    "    /// The kernel `{name}`.\n    pub const {}: &str = {name:?};",
                    name.to_uppercase()
                )
                .unwrap();
                if group_of(name) != "hopper" {
                    all.push(name.to_uppercase());
                }
            }
        }
    }
    // In the order of preference per head_dim: the deeper ring first (`Context::decode_plan`
    // takes the first that fits the device's shared memory).
    decoders.sort_by_key(|d| (d.dtype, d.head_dim, std::cmp::Reverse(d.stages)));
    let decode: String = decoders
        .iter()
        .map(|DecoderName { dtype, head_dim, stages, entry }| {
            format!(
                "    DecodeInstance {{ dtype: DType::{dtype}, head_dim: {head_dim}, stages: {stages}, entry: {entry:?} }},\n"
            )
        })
        .collect();
    // The Hopper kernels exist only as PTX: the emulator does not model their asynchronous units.
    let emulated: String = entries
        .iter()
        .filter(|name| group_of(name) != "hopper")
        .map(|name| format!("        {name:?} => Some(&attn_kernels::kernels::emu_{name}),\n"))
        .collect();
    format!(
        "/// `.entry` names of the kernels that have a single instance.\npub mod entry {{\n{plain}    \
         /// All of the above but the Hopper probes (which only compute capability 9.0 runs).\n    pub const ALL: &[&str] = &[{}];\n}}\n\n\
         /// Every compiled FlashAttention instance of the sm_80 modules.\n\
         pub const FLASH_INSTANCES: &[FlashInstance] = &[\n{flash}];\n\n\
         /// Every compiled Hopper (sm_90a) FlashAttention instance.\n\
         pub const HOPPER_INSTANCES: &[HopperInstance] = &[\n{hopper}];\n\n\
         /// Every compiled KV-cache decoder, by element type and head_dim, the deeper ring first.\n\
         pub const DECODE_INSTANCES: &[DecodeInstance] = &[\n{decode}];\n\n\
         /// The CPU emulator's entry for a kernel of the PTX, by its `.entry` name.\n\
         pub fn emulated(name: &str) -> Option<&'static attn_kernels::emu::HostKernel> {{\n    match name {{\n{emulated}        _ => None,\n    }}\n}}\n",
        all.join(", ")
    )
}

/// What the name of a KV-cache decoder instance says: `decode_fwd_{dtype}_d{head_dim}_s{stages}`
/// (`kernels/src/sm80/decode.rs`). (Its resident blocks per SM the host asks the driver for.)
struct DecoderName {
    dtype: &'static str,
    head_dim: usize,
    stages: usize,
    entry: String,
}

/// Parses a decoder's entry name; `None` for any other kernel (the merge and append kernels of
/// level 10 have single instances).
fn decoder_instance(name: &str) -> Option<DecoderName> {
    let rest = name.strip_prefix("decode_fwd_")?;
    let (dtype, dims) = rest.split_once("_d")?;
    let (_, dtype) = DTYPES.iter().find(|(d, _)| *d == dtype)?;
    let (head_dim, stages) = dims.split_once("_s")?;
    let number = |part: &str| part.parse().unwrap_or_else(|_| fail(&format!("unexpected kernel name {name}")));
    Some(DecoderName { dtype, head_dim: number(head_dim), stages: number(stages), entry: name.into() })
}

/// What the name of a FlashAttention instance says.
struct FlashName {
    variant: &'static str,
    dtype: &'static str,
    block_m: usize,
    block_n: usize,
    head_dim: usize,
    stages: usize,
    /// A Hopper kernel (`hopper_` prefix).
    hopper: bool,
    /// The `HopperVariant` of a Hopper kernel: `PingPong` (`_pingpong` suffix, a forward whose
    /// consumers take turns), `Deterministic` (`_deterministic`, a backward that adds dQ in a
    /// fixed order), else `Plain`.
    hopper_variant: &'static str,
    /// Runs head dims below `head_dim` too: `_padded` tensor-core instances, every `f32` one.
    padded: bool,
}

/// Parses `[hopper_]{family}_{dtype}_m{block_m}_n{block_n}_d{head_dim}[_s{stages}][_pingpong|_deterministic|_padded]`;
/// `None` for other kernels.
fn flash_instance(name: &str) -> Option<FlashName> {
    // A Hopper backward's `_mods` twin (the entry for problems with a score modification) is not
    // an instance of its own: the host derives its name from the plain one's (`modified_entry`).
    if name.ends_with("_mods") {
        return None;
    }
    let (hopper, rest) = match name.strip_prefix("hopper_") {
        Some(rest) => (true, rest),
        None => (false, name),
    };
    let suffixes = [("_pingpong", "PingPong"), ("_deterministic", "Deterministic")];
    let found = suffixes.iter().find_map(|(suffix, variant)| Some((*variant, rest.strip_suffix(suffix)?)));
    let (hopper_variant, rest) = match found {
        Some(found) if hopper => found,
        _ => ("Plain", rest),
    };
    let (padded_suffix, rest) = match rest.strip_suffix("_padded") {
        Some(rest) => (true, rest),
        None => (false, rest),
    };
    let (prefix, dims) = rest.rsplit_once("_m")?;
    let (family, dtype) = prefix.rsplit_once('_')?;
    let (_, variant) = FLASH_FAMILIES.iter().find(|(p, _)| *p == family)?;
    let (_, dtype) = DTYPES.iter().find(|(d, _)| *d == dtype)?;
    let numbers: Vec<usize> = dims
        .split('_')
        .map(|part| {
            part.trim_start_matches(['n', 'd', 's'])
                .parse()
                .unwrap_or_else(|_| fail(&format!("unexpected kernel name {name}")))
        })
        .collect();
    let (block_m, block_n, head_dim, stages) = match numbers[..] {
        [m, n, d] => (m, n, d, 1),
        [m, n, d, s] => (m, n, d, s),
        _ => fail(&format!("unexpected kernel name {name}")),
    };
    let padded = padded_suffix || *dtype == "F32";
    Some(FlashName { variant, dtype, block_m, block_n, head_dim, stages, hopper, hopper_variant, padded })
}

/// The file name of module group `group`'s PTX (in `OUT_DIR`; shipped in [`SHIPPED_DIR`] with
/// `.xz` appended): `kernels_sm_80_tensor_cores.ptx`, for one.
fn module_file(group: &ModuleGroup) -> String {
    format!("kernels_{}_{}.ptx", group.arch, group.name)
}

/// Fails the build unless the `sm_75` modules hold exactly the `sm_80` modules' kernels that
/// Turing runs, module for module: the host takes a Turing kernel by its `sm_80` name.
fn check_turing_modules(modules: &[(&'static ModuleGroup, String)]) {
    for (turing, ptx) in modules.iter().filter(|(g, _)| g.arch == TURING_ARCH) {
        let (_, base) = modules
            .iter()
            .find(|(g, _)| g.arch == BASE_ARCH && g.name == turing.name)
            .unwrap_or_else(|| fail(&format!("the sm_75 module {} has no sm_80 module of that name", turing.name)));
        let wanted: Vec<String> = ptx_entries(base).into_iter().filter(|e| turing_group_of(e).is_some()).collect();
        if ptx_entries(ptx) != wanted {
            fail(&format!("the sm_75 module {} does not hold the same kernels as its sm_80 module", turing.name));
        }
    }
}

/// Where the shipped PTX lives, relative to this crate's manifest.
const SHIPPED_DIR: &str = "ptx";

/// The PTX of every module group, unpacked from the xz files in `dir` (what a `build-ptx` build
/// compiled, written there by `scripts/ship-ptx`).
fn shipped_ptx(dir: &Path) -> Vec<(&'static ModuleGroup, String)> {
    MODULE_GROUPS
        .iter()
        .map(|group| {
            let path = dir.join(format!("{}.xz", module_file(group)));
            let damaged = |why: String| -> ! {
                fail(&format!(
                    "the shipped PTX {} {why}. Build attn-host with its `build-ptx` feature to compile the \
                     kernels from kernels/ instead ({FIX}), or restore the file from the repository",
                    path.display()
                ))
            };
            let packed = fs::read(&path).unwrap_or_else(|e| damaged(format!("could not be read ({e})")));
            let mut ptx = Vec::new();
            lzma_rs::xz_decompress(&mut packed.as_slice(), &mut ptx)
                .unwrap_or_else(|e| damaged(format!("is not a valid xz file ({e:?})")));
            let ptx = String::from_utf8(ptx).unwrap_or_else(|_| damaged("is not text".into()));
            if !ptx.contains(".visible .entry ") {
                damaged("holds no kernel".into());
            }
            (group, ptx)
        })
        .collect()
}

/// Builds `kernels/` and returns the PTX text of each module group, in [`MODULE_GROUPS`]' order.
fn build_ptx(kernels_dir: &Path, out_dir: &Path, tools: &LlvmTools) -> Vec<(&'static ModuleGroup, String)> {
    // The two builds of the device crate run at once (each is one codegen unit: one core).
    let builds: Vec<(&str, Bitcode)> = std::thread::scope(|scope| {
        let handles: Vec<_> = [BASE_ARCH, TURING_ARCH]
            .map(|arch| (arch, scope.spawn(move || build_bitcode(kernels_dir, out_dir, arch, tools))))
            .into_iter()
            .collect();
        handles.into_iter().map(|(arch, handle)| (arch, handle.join().unwrap())).collect()
    });
    // The module groups, as many at a time as cargo's job count allows (`NUM_JOBS`: `-j`, or
    // the cores): each is an `opt` and an `llc` of its own.
    let jobs = env::var("NUM_JOBS").ok().and_then(|n| n.parse::<usize>().ok()).filter(|&n| n > 0);
    let workers =
        jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).min(MODULE_GROUPS.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut modules: Vec<(usize, &'static ModuleGroup, String)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(group) = MODULE_GROUPS.get(index) else { break done };
                        let (_, bitcode) = builds.iter().find(|(arch, _)| *arch == group.build_arch()).unwrap();
                        done.push((index, group, module_ptx(group, bitcode, tools)));
                    }
                })
            })
            .collect();
        handles.into_iter().flat_map(|handle| handle.join().unwrap()).collect()
    });
    modules.sort_by_key(|(index, _, _)| *index);
    modules.into_iter().map(|(_, group, ptx)| (group, ptx)).collect()
}

/// One build of the device crate: its linked bitcode and the kernels in it.
struct Bitcode {
    target_dir: PathBuf,
    linked: PathBuf,
    kernels: Vec<String>,
}

/// Builds `kernels/` for target CPU `arch` and links its bitcode with what it uses of `core`.
fn build_bitcode(kernels_dir: &Path, out_dir: &Path, arch: &str, tools: &LlvmTools) -> Bitcode {
    let target_dir = out_dir.join("kernels-target").join(arch);
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(kernels_dir)
        .args(["rustc", "--release", "--locked", "-Zbuild-std=core", "--target", NVPTX_TARGET])
        .args(["--crate-type", "staticlib"])
        .args(["--config", "profile.release.panic='abort'", "--config", "profile.release.codegen-units=1"])
        .args(["--config", "profile.release.opt-level=3", "--config", "profile.release.debug=false"])
        .arg("--target-dir")
        .arg(&target_dir)
        // Flags meant for the host build (and cargo's own target settings) must not reach the
        // device build; the device build gets only its target CPU.
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_TARGET")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env("CARGO_ENCODED_RUSTFLAGS", format!("-Ctarget-cpu={arch}"));
    let status = cmd.status().unwrap_or_else(|e| fail(&format!("could not run cargo for the kernels: {e}")));
    if !status.success() {
        fail(&format!(
            "building kernels/ for {NVPTX_TARGET} ({arch}) failed (see the errors above). If they say that \
             `core` or the target is missing, {FIX}."
        ));
    }

    // Unpack the archive: one bitcode object per crate (codegen-units = 1).
    let archive = target_dir.join(NVPTX_TARGET).join("release").join(format!("lib{KERNEL_CRATE}.a"));
    let objects_dir = target_dir.join("bitcode");
    let _ = fs::remove_dir_all(&objects_dir);
    fs::create_dir_all(&objects_dir).unwrap();
    run(Command::new(&tools.llvm_ar).current_dir(&objects_dir).arg("x").arg(&archive));
    let mut kernel_objects = Vec::new();
    let mut library_objects = Vec::new();
    for entry in fs::read_dir(&objects_dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().and_then(OsStr::to_str).unwrap_or_default();
        if name.starts_with(&format!("{KERNEL_CRATE}-")) {
            kernel_objects.push(path);
        } else {
            library_objects.push(path); // core, compiler_builtins
        }
    }
    kernel_objects.sort();
    library_objects.sort();
    if kernel_objects.is_empty() {
        fail(&format!("{} holds no object of the kernel crate", archive.display()));
    }

    let kernels_bc = target_dir.join("kernels.bc");
    let linked_bc = target_dir.join("linked.bc");
    run(Command::new(&tools.llvm_link).args(&kernel_objects).arg("-o").arg(&kernels_bc));
    run(Command::new(&tools.llvm_link)
        .arg(&kernels_bc)
        .args(["--only-needed", "--internalize"])
        .args(&library_objects)
        .arg("-o")
        .arg(&linked_bc));

    // The kernels are the module's external functions (core's were internalised above).
    let output = Command::new(&tools.llvm_nm)
        .args(["--defined-only", "--extern-only", "--format=just-symbols"])
        .arg(&linked_bc)
        .output()
        .unwrap_or_else(|e| fail(&format!("could not run llvm-nm: {e}")));
    let kernels: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::trim)
        .filter(|name| {
            ["flash_", "naive_", "vector_add", "hopper_", "decode_"].iter().any(|prefix| name.starts_with(prefix))
        })
        .map(String::from)
        .collect();

    Bitcode { target_dir, linked: linked_bc, kernels }
}

/// The PTX of module `group`: its kernels kept from the linked bitcode of its build (every
/// other one made internal, then dropped as unused), optimised, and written for its
/// architecture.
fn module_ptx(group: &ModuleGroup, bitcode: &Bitcode, tools: &LlvmTools) -> String {
    let ModuleGroup { name, arch, ptx_version, opt_flags } = group;
    let keep: Vec<&str> = bitcode.kernels.iter().map(String::as_str).filter(|k| group.holds(k)).collect();
    let file = |extension: &str| bitcode.target_dir.join(format!("{arch}_{name}.{extension}"));
    let (kept_bc, optimized_bc, ptx_path) = (file("bc"), file("opt.bc"), file("ptx"));
    run(Command::new(&tools.opt)
        .args(["-passes=internalize,globaldce", &format!("-internalize-public-api-list={}", keep.join(","))])
        .arg(&bitcode.linked)
        .arg("-o")
        .arg(&kept_bc));
    run(Command::new(&tools.opt).arg("-O3").args(opt_flags).arg(&kept_bc).arg("-o").arg(&optimized_bc));
    run(Command::new(&tools.llc)
        .args(["-O3", &format!("-mcpu={arch}"), &format!("-mattr=+{ptx_version}")])
        .arg(&optimized_bc)
        .arg("-o")
        .arg(&ptx_path));
    let ptx = fs::read_to_string(&ptx_path).unwrap();
    // Turing's modules get no bounds: a T4's 64 KiB of shared memory hold at most one block of
    // the tiles that have them an SM (the head_dim-128 forward with 32-key tiles; the d128
    // decoder does not fit at all), so a bound asking for three would only cost registers there
    // (ptxas spilled 24 bytes in that forward).
    if *arch == TURING_ARCH { ptx } else { with_launch_bounds(ptx) }
}

/// The device crate's table of compiled configurations: its `launch_bounds` are written into the
/// PTX here (its macros are for the device crate and unused in this one).
#[path = "../kernels/src/configs.rs"]
#[allow(unused_macros, dead_code)]
mod configs;

/// `ptx` with the directives of `configs::launch_bounds` (`__launch_bounds__(threads,
/// min_blocks)` as `.maxntid threads, 1, 1` and `.minnctapersm min_blocks`) after the parameter
/// lists of their kernels.
fn with_launch_bounds(ptx: String) -> String {
    let mut out = String::with_capacity(ptx.len() + 256);
    let mut pending: Option<(u32, u32)> = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(name) = line.trim_start().strip_prefix(".visible .entry ") {
            let name = name.split('(').next().unwrap_or_default().trim();
            // A band-table twin has its plain entry's bounds (`attention_kernel!`).
            let name = name.strip_suffix(TABLE_TWIN).unwrap_or(name);
            pending = configs::launch_bounds(name);
        } else if line.trim_start().starts_with(')')
            && let Some((threads, blocks)) = pending.take()
        {
            out.push_str(&format!(".maxntid {threads}, 1, 1\n.minnctapersm {blocks}\n"));
        }
    }
    out
}

/// Fails the build if a kernel named in `configs::LAUNCH_BOUNDS` is in none of the modules (a
/// renamed or removed kernel must not silently lose its bounds), or if a Hopper flash kernel has
/// a name that `configs::launch_bounds` cannot read its bounds from (`setmaxnreg` needs them).
fn check_launch_bounds(modules: &[(&'static ModuleGroup, String)]) {
    let entries: Vec<String> = modules.iter().flat_map(|(_, ptx)| ptx_entries(ptx)).collect();
    for (name, _, _) in configs::LAUNCH_BOUNDS {
        if !entries.iter().any(|entry| entry == name) {
            fail(&format!("kernels/src/configs.rs names `{name}` in LAUNCH_BOUNDS, but no kernel has that name"));
        }
    }
    for entry in entries.iter().filter(|entry| entry.starts_with("hopper_flash_")) {
        if configs::launch_bounds(entry).is_none() {
            fail(&format!(
                "no launch bounds for the Hopper kernel `{entry}`: configs::launch_bounds reads them from its name"
            ));
        }
    }
}

/// Names of the `.entry` functions (kernels) in a PTX module, sorted.
fn ptx_entries(ptx: &str) -> Vec<String> {
    let mut names: Vec<String> = ptx
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap().trim().to_string())
        .collect();
    names.sort();
    names
}

/// The LLVM tools of the active toolchain's `llvm-tools` component.
struct LlvmTools {
    llvm_ar: PathBuf,
    llvm_nm: PathBuf,
    llvm_link: PathBuf,
    opt: PathBuf,
    llc: PathBuf,
}

impl LlvmTools {
    fn find() -> Self {
        let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
        let output = Command::new(&rustc)
            .args(["--print", "sysroot"])
            .output()
            .unwrap_or_else(|e| fail(&format!("could not run {rustc}: {e}")));
        let sysroot = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
        let host = env::var("HOST").unwrap();
        let bin = sysroot.join("lib").join("rustlib").join(&host).join("bin");
        let tool = |name: &str| {
            let path = bin.join(format!("{name}{}", env::consts::EXE_SUFFIX));
            if !path.exists() {
                fail(&format!("{} is missing (the llvm-tools component): {FIX}", path.display()));
            }
            path
        };
        let rust_src = sysroot.join("lib").join("rustlib").join("src").join("rust").join("library").join("core");
        if !rust_src.exists() {
            fail(&format!("the rust-src component is missing (needed to build `core` for {NVPTX_TARGET}): {FIX}"));
        }
        Self {
            llvm_ar: tool("llvm-ar"),
            llvm_nm: tool("llvm-nm"),
            llvm_link: tool("llvm-link"),
            opt: tool("opt"),
            llc: tool("llc"),
        }
    }
}

fn run(cmd: &mut Command) {
    let status = cmd.status().unwrap_or_else(|e| fail(&format!("could not run {cmd:?}: {e}")));
    if !status.success() {
        fail(&format!("{cmd:?} failed with {status}"));
    }
}

fn fail(message: &str) -> ! {
    eprintln!("\nerror: building the GPU kernels: {message}\n");
    exit(1)
}
