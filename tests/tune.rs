//! The tuned-tiles file (`rust-attention --tune`) and the sweep's guards, on the CPU: picking the
//! fastest measurement per case, the JSON round trip, another device's file being ignored, a
//! corrupt file being a clear error, tiles that are no longer compiled being skipped, and the
//! sweep refusing the emulator (it measures a GPU).

use attn_host::tune::{Pass, SweepTiming, TileMeasurement, TunedTiles, sweep_tiles};
use attn_host::{AttentionShape, Causal, Context, DType, DeviceInfo, DqAccumulation, Error, TileConfig};

fn h200() -> DeviceInfo {
    DeviceInfo {
        ordinal: 0,
        name: "NVIDIA H200".into(),
        compute_capability: (9, 0),
        sm_count: 132,
        max_shared_memory_per_block: 227 * 1024,
        total_memory: 141 << 30,
    }
}

fn measurement(pass: Pass, causal: bool, tile: TileConfig, dq: Option<DqAccumulation>, tflops: f64) -> TileMeasurement {
    TileMeasurement {
        pass,
        dtype: DType::F16,
        head_dim: 64,
        causal,
        tile,
        dq,
        registers: 128,
        shared_memory_bytes: 48 * 1024,
        threads: 128,
        blocks_per_sm: 2,
        ms: 1000.0 / tflops,
        tflops,
    }
}

fn tuned() -> TunedTiles {
    let fast = TileConfig::new(64, 64).with_stages(2);
    let slow = TileConfig::new(128, 64).with_stages(2);
    let measurements = [
        measurement(Pass::Forward, false, slow, None, 250.0),
        measurement(Pass::Forward, false, fast, None, 260.0),
        measurement(Pass::Forward, true, slow, None, 230.0),
        measurement(Pass::Backward, false, fast, Some(DqAccumulation::Atomic), 130.0),
        measurement(Pass::Backward, false, fast, Some(DqAccumulation::Deterministic), 160.0),
    ];
    TunedTiles::from_measurements(&h200(), [4, 16, 4096], &measurements)
}

#[test]
fn the_fastest_measurement_of_each_case_is_kept() {
    let tuned = tuned();
    assert_eq!(tuned.tiles.len(), 3, "one entry per (pass, dtype, head_dim, causal)");
    let forward = tuned.tile(Pass::Forward, DType::F16, 64, Causal::None).expect("tuned");
    assert_eq!(forward.tile, TileConfig::new(64, 64).with_stages(2));
    let causal = tuned.tile(Pass::Forward, DType::F16, 64, Causal::BottomRight).expect("either mask alignment");
    assert_eq!(causal.tile, TileConfig::new(128, 64).with_stages(2));
    let backward = tuned.tile(Pass::Backward, DType::F16, 64, Causal::None).expect("tuned");
    assert_eq!(backward.dq, Some(DqAccumulation::Deterministic));
    assert!(tuned.tile(Pass::Backward, DType::F16, 64, Causal::TopLeft).is_none(), "not tuned");
    assert!(tuned.tile(Pass::Forward, DType::Bf16, 64, Causal::None).is_none(), "not tuned");
}

#[test]
fn the_file_round_trips_and_names_its_device() {
    let dir = std::env::temp_dir().join(format!("rust-attention-tune-{}", std::process::id()));
    let path = dir.join("nested").join("tuned-tiles.json");
    let tuned = tuned();
    tuned.save(&path).expect("saved");
    assert_eq!(TunedTiles::load(&path, &h200()).expect("read"), Some(tuned.clone()));
    let other = DeviceInfo { name: "NVIDIA A100-SXM4-80GB".into(), compute_capability: (8, 0), ..h200() };
    assert_eq!(TunedTiles::load(&path, &other).expect("read"), None, "another device ignores the file");
    let cut_down = DeviceInfo { sm_count: 114, ..h200() };
    assert_eq!(TunedTiles::load(&path, &cut_down).expect("read"), None, "same name, fewer SMs");
    assert_eq!(TunedTiles::load(&dir.join("missing.json"), &h200()).expect("no file is fine"), None);
    std::fs::write(&path, "{ not json").expect("written");
    let error = TunedTiles::load(&path, &h200()).expect_err("corrupt file");
    assert!(matches!(error, Error::TunedTiles { .. }), "{error}");
    assert!(error.to_string().contains("tuned-tiles.json"), "the error names the file: {error}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_tile_no_longer_compiled_is_skipped() {
    let mut tuned = tuned();
    for t in &mut tuned.tiles {
        t.tile = TileConfig::new(48, 48).with_stages(2); // never compiled
    }
    assert!(tuned.tile(Pass::Forward, DType::F16, 64, Causal::None).is_none());
}

#[test]
fn the_sweep_needs_a_gpu() {
    let ctx = Context::cpu_emulated();
    let shape = AttentionShape { batch: 1, num_heads_q: 1, num_heads_kv: 1, seqlen_q: 64, seqlen_k: 64, head_dim: 64 };
    let result =
        sweep_tiles(&ctx, &shape, DType::F16, Causal::None, Pass::Forward, SweepTiming::default(), &mut |_| {});
    assert!(matches!(result, Err(Error::NotOnEmulator(_))), "{:?}", result.err());
}
