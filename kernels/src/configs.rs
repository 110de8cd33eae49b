//! Every compiled kernel configuration, in one file: the tile lists of each tier, the register
//! budgets of the Hopper kernels and the launch bounds that `host/build.rs` writes into the PTX.
//!
//! The kernel files instantiate their entries by calling the list macros below with an instance
//! macro of their own; `host/build.rs` includes this file too (for [`launch_bounds`]) and the
//! host's registry is generated from the entry names that reach the PTX. To compile another tile
//! or head_dim, add it to the list here (and, for the host to pick it by default, to its
//! selection policy). Lists hold only what was measured to pay (PERFORMANCE.md says why each
//! configuration is there and which ones were left out).
//!
//! Instance macros are called as `$instance!(block_m, block_n, head_dim)` for the `f32` tier and
//! as `$instance!(dtype, Format, …)` for the 16-bit tiers, first for every configuration in `f16`
//! (`hw::F16`), then in `bf16` (`hw::Bf16`).

/// The suffix of a flash kernel's band-table twin: every sm_80-path flash kernel `name` (levels
/// 3–6) is compiled twice, `name` for problems without a band table (the mask made table-free
/// where the kernel starts) and `name` + this for problems with one (`attention_kernel!`'s
/// `table twin` form in `lib.rs`, which spells the same suffix in the identifiers it makes;
/// the host's test `every_entry_is_in_the_ptx` checks that they agree). `host/build.rs` puts the
/// twins in modules of their own and gives them their plain kernel's launch bounds; the host
/// launches a twin exactly when a table is bound (`attn_host::kernels::table_twin`).
pub const TABLE_TWIN_SUFFIX: &str = "_table";

/// Calls `$instance!(block_m, block_n, head_dim)` for every compiled `f32` FlashAttention tile
/// (levels 3 and 4): every `block_m` and `block_n` of 16, 32, 64 with every head_dim of 32, 64,
/// 128, and the tiles of 16 and 32 at head_dim 256 (larger ones need more shared memory than
/// most GPUs have: three 64 × 256 `f32` tiles are 192 KiB). A head_dim in between runs on the
/// next compiled one, its padding columns zero in shared memory and never read from or written
/// to device memory (the thread grid needs multiples of 32).
macro_rules! simt_tiles {
    ($instance:ident) => {
        cross_product!($instance, [16 32 64], [16 32 64], [32 64 128]);
        cross_product!($instance, [16 32], [16 32], [256]);
    };
}

/// Calls `$instance!(dtype, Format, block_m, block_n, head_dim, stages)` for every compiled
/// tensor-core forward tile (level 5), by head_dim: 32, 64, 96, 128, 160, 192, 256 (a head_dim in
/// between runs on the next one, with padding columns that never touch device memory). Tiles
/// that ptxas cannot fit in 255 registers without spilling are left out, fast or not: (128, 128)
/// at head_dim 64 and (128, 64) at 128 were a little faster than the tiles below but spill
/// (PERFORMANCE.md). Above 128 only 64-row tiles fit (the O accumulator is `head_dim / 2`
/// registers a thread per 16 rows).
macro_rules! sm80_forward_tiles {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [
                (64, 64, 32, 2),
                (128, 64, 32, 2),
                (64, 32, 64, 2),
                (64, 64, 64, 2),
                (64, 64, 64, 3),
                (128, 64, 64, 2),
                (64, 32, 128, 2),
                (64, 32, 128, 3),
                (64, 64, 128, 2),
                (128, 32, 128, 2),
                (64, 32, 96, 2),
                (64, 64, 96, 2),
                (128, 32, 96, 2),
                (64, 32, 160, 2),
                (64, 64, 160, 2),
                (64, 32, 192, 2),
                (64, 32, 256, 2),
            ]
        );
    };
}

/// Calls `$instance!(dtype, Format, head_dim, stages, q_in_registers)` for every compiled decoder
/// (level 10): head dims 64, 128, 160 and 256 (each also runs the head dims below it, down to the
/// previous one, with zero columns that never touch device memory: the decoder is bound by
/// memory, not by the products). Rings of 3 stages: deeper ones (6 and 10 were tried) cost
/// resident blocks, which the decoder needs more than bytes in flight (PERFORMANCE.md, issue
/// 22). The 2-stage instances keep Q in shared memory, not registers, and are there for smaller
/// GPUs: at 128 it fits three blocks an SM (its launch bound in [`LAUNCH_BOUNDS`]; slower on the
/// H200 than two blocks of the 3-stage one) and 99 KiB a block, at 160 it is the widest that
/// fits 99 KiB (the head dims up to 160 there), at 256 it fits an A100's 163 KiB (140.5 KiB; the
/// 3-stage one needs 206.5).
macro_rules! decode_tiles {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [(64, 3, true), (128, 3, true), (128, 2, false), (160, 2, false), (256, 3, false), (256, 2, false)]
        );
    };
}

/// Calls `$instance!(dtype, Format, block_m, block_n, head_dim, stages)` for every compiled
/// tensor-core backward tile (level 6), each for its three kernels, at head_dim 32, 64, 96, 128,
/// 192 and 256 (a head_dim in between runs on the next one). The K/V-outer kernels have a warp
/// per 16 keys, the dQ kernel per 16 queries. Each warp keeps dK and dV of its 16 keys (or dQ of
/// its queries) in registers, `head_dim` a thread: above 128 they no longer fit, and two warps
/// share the 16 rows, half of the columns each (`layout::mma_backward_column_warps`). At 256 the
/// query tile is 32 rows, so that the K/V-outer kernel fits an A100's shared memory (141 KiB).
/// The smaller tiles at 192 and 256 are for smaller GPUs: (32, 32) at 192 and (16, 32) at 256 are
/// the largest whose three kernels fit 99 KiB a block (an RTX 3090/4090, an L4), and (16, 32) at
/// 256 also the largest whose dQ kernel fits an A100's 163 KiB (at (32, 64) it needs 165 KiB).
macro_rules! sm80_backward_tiles {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [
                (64, 64, 32, 2),
                (64, 128, 32, 2),
                (64, 64, 64, 2),
                (64, 128, 64, 2),
                (32, 128, 64, 2),
                (64, 64, 96, 2),
                (32, 64, 96, 2),
                (64, 64, 128, 2),
                (32, 64, 128, 2),
                (32, 128, 128, 2),
                (64, 64, 192, 2),
                (32, 32, 192, 2),
                (32, 64, 256, 2),
                (16, 32, 256, 2)
            ]
        );
    };
}

/// Calls `$instance!(dtype, Format, block_m, head_dim, block_n, stages, pingpong, variant)` for
/// every compiled Hopper forward configuration (level 8), measured fastest on an H200. At
/// head_dim 64 the softmax costs as much as the products: three consumer warpgroups (block_m
/// 192) keep the tensor cores busier than two taking ping-pong turns, but make fewer, longer
/// blocks, which lose where the grid is only a few waves deep; the host picks by grid size. At
/// head_dim 128 the products dominate, registers allow only two consumers, and the turns only add
/// waiting. Above 128 the K/V tiles shrink so that two stages fit beside Q and the S and P
/// registers beside O (`head_dim / 2` a thread): 96 keys at 160 and 192, 64 at 256 (80, FlashAttention-3's
/// choice there, spills in the consumers).
#[allow(unused_macros)] // used on nvptx64 only
macro_rules! sm90_forward_configs {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [
                (192, 64, 128, 2, false, s2),
                (128, 64, 128, 2, true, s2_pingpong),
                (64, 64, 128, 2, false, s2),
                (64, 64, 64, 2, false, s2),
                (128, 80, 128, 2, false, s2),
                (128, 96, 128, 2, false, s2),
                (128, 128, 128, 2, false, s2),
                (128, 160, 96, 2, false, s2),
                (128, 192, 96, 2, false, s2),
                (128, 256, 64, 2, false, s2)
            ]
        );
    };
}

/// Calls `$instance!(dtype, Format, block_m, block_n, head_dim, stages, padded)` for the
/// tensor-core forward tiles that also have a *padded* instance (`layout::row_length`), which
/// runs the head dims below `head_dim` down to the next compiled one: the default tile of each
/// head_dim (`TileConfig::default_for_dtype`), and (64, 32) at 128, the tile that fits a T4's
/// 64 KiB a block between 96 and 128 (its Q tile borrows a ring slot, `layout::q_shares_ring`).
/// The instances in [`sm80_forward_tiles!`] are exact: a run-time row length would cost the
/// hottest ones registers they do not have.
macro_rules! sm80_padded_forward_tiles {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [
                (128, 64, 32, 2, padded),
                (128, 64, 64, 2, padded),
                (64, 64, 96, 2, padded),
                (128, 32, 128, 2, padded),
                (64, 32, 128, 2, padded),
                (64, 32, 160, 2, padded),
                (64, 32, 192, 2, padded),
                (64, 32, 256, 2, padded)
            ]
        );
    };
}

/// As [`sm80_padded_forward_tiles!`] for the backward: the default tile of each head_dim
/// (`TileConfig::default_backward_for_dtype`), each for its three kernels, and the tiles that
/// fit smaller GPUs, so that every head_dim runs there (`Context::default_backward_tile` picks
/// them): from 128 up 99 KiB a block (at 256 also an A100's deterministic dQ kernel), and up to
/// 192 a T4's 64 KiB ((32, 64) at 64, (32, 32) at 96 and 128, (16, 32) at 192).
macro_rules! sm80_padded_backward_tiles {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [
                (64, 128, 32, 2, padded),
                (64, 128, 64, 2, padded),
                (32, 64, 64, 2, padded),
                (64, 64, 96, 2, padded),
                (32, 32, 96, 2, padded),
                (64, 64, 128, 2, padded),
                (32, 64, 128, 2, padded),
                (32, 32, 128, 2, padded),
                (64, 64, 192, 2, padded),
                (32, 32, 192, 2, padded),
                (16, 32, 192, 2, padded),
                (32, 64, 256, 2, padded),
                (16, 32, 256, 2, padded)
            ]
        );
    };
}

/// Calls `$instance!(dtype, Format, head_dim, block_n, stages, dq modes)` for every compiled
/// Hopper backward configuration (level 9; query tiles of 64, `block_n` keys a block as
/// `layout::hopper_backward_block_n` says): up to head_dim 128 compiled twice, with dQ added in
/// any order and in a fixed one (`deterministic`); the wide-head kernel above 128 in any order
/// only (`atomic`: its deterministic mode runs on the sm_80 kernels).
#[allow(unused_macros)] // used on nvptx64 only
macro_rules! sm90_backward_configs {
    ($instance:ident) => {
        each_half_format!(
            $instance,
            [
                (64, 128, 2, deterministic),
                (80, 128, 2, deterministic),
                (96, 128, 2, deterministic),
                (128, 128, 2, deterministic),
                (160, 64, 2, atomic),
                (192, 64, 2, atomic),
                (256, 64, 2, atomic)
            ]
        );
    };
}

/// Per-thread register budgets of the Hopper forward after `setmaxnreg`, (producer, consumers),
/// with two consumer warpgroups (block_m 128, 384 threads). The launch gives every thread
/// 65536 registers / threads, rounded down to a multiple of 8: 168 for 384 threads. The producer
/// only issues copies; the consumers take the rest: 56 + 2 · 224 = 3 · 168. (With fewer than
/// about 48 registers the producer's loop spills a little; the consumers matter more.)
pub const SM90_FORWARD_REGISTERS_M128: (u32, u32) = (56, 224);

/// As [`SM90_FORWARD_REGISTERS_M128`] above head_dim 192, where the O accumulator alone is
/// `head_dim / 2` registers a consumer thread (128 at 256): the producer keeps 40, the consumers
/// take 232 (40 + 2 · 232 = 3 · 168). With 224 the head_dim-256 consumers spill a few values in
/// their loop; with 40 the producer spills a few in its loop instead, which costs far less (one
/// thread, a few words per 32 KiB tile). Head_dim 192 fits the common budget without spills.
pub const SM90_FORWARD_REGISTERS_M128_WIDE: (u32, u32) = (40, 232);

/// As [`SM90_FORWARD_REGISTERS_M128`] with three consumer warpgroups (block_m 192, 512
/// threads, 128 registers each at launch): 32 + 3 · 160 = 4 · 128.
pub const SM90_FORWARD_REGISTERS_M192: (u32, u32) = (32, 160);

/// As [`SM90_FORWARD_REGISTERS_M128`] with one consumer warpgroup (block_m 64, 256 threads) and
/// two blocks per SM (128 registers each at launch): 32 + 224 = 2 · 128. The consumer keeps the
/// 224 of the two-consumer kernel, whose loop it runs; the second resident block overlaps one
/// block's prologue and epilogue with the other's products (short sequences, issue 20).
pub const SM90_FORWARD_REGISTERS_M64: (u32, u32) = (32, 224);

/// As [`SM90_FORWARD_REGISTERS_M64`] with 64-key tiles and three blocks per SM (80 registers
/// each at launch): 32 + 128 = 2 · 80. S and P take half the registers of the 128-key tile, so
/// the consumer fits in 128; a third resident block gives each scheduler a third consumer warp
/// to hide the softmax's dependent chain (short sequences, issue 20).
pub const SM90_FORWARD_REGISTERS_M64_N64: (u32, u32) = (32, 128);

/// Register budgets of the Hopper backward (producer, consumers), of 168 each at launch (384
/// threads): 40 + 2 · 232 = 3 · 168.
pub const SM90_BACKWARD_REGISTERS: (u32, u32) = (40, 232);

/// Kernels that get CUDA's `__launch_bounds__(threads, min_blocks)`, as PTX directives that
/// `host/build.rs` writes after their parameter lists (`.maxntid threads, 1, 1` and
/// `.minnctapersm min_blocks`): ptxas then keeps their registers low enough for `min_blocks`
/// blocks per SM. Rust cannot attach these to a function. A name here that no kernel has fails
/// the build. Turing's copies (the sm_75 modules) get none: a T4's shared memory holds one block
/// of these tiles an SM at most.
///
/// * The Hopper kernels need theirs: they move registers between warpgroups with `setmaxnreg`,
///   which works on the budget ptxas derives from the block's threads (see the register budgets
///   above). They are not listed: [`launch_bounds`] reads theirs from their names, so that a
///   Hopper configuration is one line in its list above.
/// * The head_dim-128 tensor-core forward tiles with 32-key tiles need 171 registers on their
///   own, 3 too many for 3 blocks of 128 threads per SM (65536 / 384 = 170), and fit in 168
///   without spilling (PERFORMANCE.md). Forcing the 64-key tile (251 registers) down to 168
///   spills and loses: it is not bounded.
pub const LAUNCH_BOUNDS: &[(&str, u32, u32)] = &[
    ("decode_fwd_f16_d128_s2", 128, 3),
    ("decode_fwd_bf16_d128_s2", 128, 3),
    ("flash_fwd_f16_m64_n32_d128_s2", 128, 3),
    ("flash_fwd_bf16_m64_n32_d128_s2", 128, 3),
    ("flash_fwd_f16_m64_n32_d128_s3", 128, 3),
    ("flash_fwd_bf16_m64_n32_d128_s3", 128, 3),
];

/// The launch bounds of kernel `name` (threads, blocks per SM), if it has any: a Hopper kernel's
/// from its name (`hopper_flash_{fwd,bwd}_{dtype}_m{block_m}_…`), the others' from
/// [`LAUNCH_BOUNDS`]. A Hopper block is a producer warpgroup and one consumer warpgroup per 64
/// query rows (the forward; `layout::hopper_forward_threads`) or two consumers (the backward);
/// the block_m-64 forward runs two blocks an SM (three with 64-key tiles), the others one (their
/// register budgets above).
pub fn launch_bounds(name: &str) -> Option<(u32, u32)> {
    if let Some(rest) = name.strip_prefix("hopper_flash_") {
        let field =
            |prefix: char| -> Option<u32> { rest.split('_').find_map(|part| part.strip_prefix(prefix)?.parse().ok()) };
        let (block_m, block_n) = (field('m')?, field('n')?);
        return Some(if rest.starts_with("fwd_") {
            let blocks = match (block_m, block_n) {
                (64, 64) => 3,
                (64, _) => 2,
                _ => 1,
            };
            (128 * (1 + block_m / 64), blocks)
        } else {
            (384, 1)
        });
    }
    LAUNCH_BOUNDS.iter().find(|(n, _, _)| *n == name).map(|&(_, threads, blocks)| (threads, blocks))
}
