//! Every CUDA kernel compiles with NVRTC for the architectures we ship for (A100 sm_80,
//! H100 sm_90), without a GPU: NVRTC is a plain library. CI fetches it from NVIDIA's
//! PyPI wheel (`nvidia-cuda-nvrtc-cu12`, by `.ci/fetch-tools` into `.cache/nvrtc`);
//! without one the test fails naming it (or skips under `PREHEAT_ALLOW_SKIP=1`).
#![cfg(feature = "cuda")]

use preheat_engine::backend::cuda::nvrtc::{self, Image, KERNELS, Origin};
use preheat_snapshot::kernel_cache::KernelCache;

fn nvrtc_or_skip() -> bool {
    let cache = preheat_testkit::workspace_root().join(".cache/nvrtc");
    preheat_testkit::present_or_skip(
        nvrtc::ensure_loaded(&[cache]),
        "an NVRTC library",
        ".ci/fetch-tools, or set PREHEAT_NVRTC_LIB",
    )
}

#[test]
fn every_kernel_compiles_with_nvrtc_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let Image::Ptx(ptx) = nvrtc::compile(arch).unwrap() else {
            panic!("{arch} must give PTX");
        };
        assert!(
            ptx.contains(&format!(".target sm_{}", &arch[8..])),
            "{arch}"
        );
        for k in KERNELS {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the {arch} PTX"
            );
        }
    }
    for arch in ["sm_80", "sm_90"] {
        let Image::Cubin(bin) = nvrtc::compile(arch).unwrap() else {
            panic!("{arch} must give a cubin");
        };
        assert_eq!(&bin[..4], b"\x7fELF", "{arch}: a cubin is an ELF image");
        for k in KERNELS {
            let needle = k.as_bytes();
            assert!(
                bin.windows(needle.len()).any(|w| w == needle),
                "{k} missing from the {arch} cubin"
            );
        }
    }
}

#[test]
fn nvrtc_images_are_restored_from_the_kernel_cache() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = KernelCache::open(dir.path()).unwrap();
    let t = std::time::Instant::now();
    let (first, o1) = nvrtc::image_for("sm_90", "570.86", Some(&cache)).unwrap();
    let compile = t.elapsed();
    let t = std::time::Instant::now();
    let (again, o2) = nvrtc::image_for("sm_90", "570.86", Some(&cache)).unwrap();
    let restore = t.elapsed();
    assert_eq!((o1, o2), (Origin::Compiled, Origin::Cache));
    assert_eq!(first, again);
    assert!(
        restore < compile,
        "restore {restore:?} vs compile {compile:?}"
    );
    eprintln!("sm_90 cubin: NVRTC {compile:?}, restored from the cache {restore:?}");
    // Another driver is another key: compiled again, not served a foreign image.
    let (_, o3) = nvrtc::image_for("sm_90", "580.1", Some(&cache)).unwrap();
    assert_eq!(o3, Origin::Compiled);
    assert_eq!(cache.entries().unwrap().len(), 2);
}
