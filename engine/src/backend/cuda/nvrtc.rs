//! The kernels' source, compiled at run time by NVRTC for the device's architecture
//! and kept in the kernel cache, so a restart loads an image instead of compiling.
//!
//! NVRTC is a separate library from the driver: it runs on machines without a GPU, which
//! is how CI checks that every kernel compiles for every architecture we ship for.
// FFI with NVRTC and the dynamic loader; every block says why it holds.
#![allow(unsafe_code)]

use std::ffi::c_char;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{CompileOptions, Ptx, sys};
use preheat_snapshot::kernel_cache::{KernelCache, KernelKey};

use crate::{EngineError, Result};

/// The CUDA C++ source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every `extern "C"` kernel in [`SOURCE`], as the backend looks them up.
pub const KERNELS: &[&str] = super::kernels::NAMES;

/// What one compilation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Image {
    /// Portable PTX for a virtual architecture (`compute_XY`); the driver finishes it.
    Ptx(String),
    /// Machine code for one real architecture (`sm_XY`); loads without JIT.
    Cubin(Vec<u8>),
}

impl Image {
    /// Bytes as stored in the kernel cache: a one-byte kind, then the image.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let (kind, body): (u8, &[u8]) = match self {
            Image::Ptx(s) => (b'P', s.as_bytes()),
            Image::Cubin(b) => (b'C', b),
        };
        let mut v = Vec::with_capacity(body.len() + 1);
        v.push(kind);
        v.extend_from_slice(body);
        v
    }

    /// The inverse of [`Image::encode`]; `None` for anything else.
    #[must_use]
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        match bytes.split_first()? {
            (b'P', body) => Some(Image::Ptx(String::from_utf8(body.to_vec()).ok()?)),
            (b'C', body) if !body.is_empty() => Some(Image::Cubin(body.to_vec())),
            _ => None,
        }
    }

    /// As cudarc loads it.
    #[must_use]
    pub fn to_ptx(&self) -> Ptx {
        match self {
            Image::Ptx(s) => Ptx::from_src(s.clone()),
            Image::Cubin(b) => Ptx::from_binary(b.clone()),
        }
    }
}

/// Whether an NVRTC library can be loaded (cudarc panics on first use otherwise).
#[must_use]
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

/// Loads `libnvrtc` from an explicit path first, so that cudarc's later load by name
/// finds it already mapped (the dynamic loader matches it by soname). This is how a
/// library from NVIDIA's PyPI wheel is used without `LD_LIBRARY_PATH`. The handle is
/// kept for the life of the process.
pub fn preload(path: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| EngineError::Model(format!("bad NVRTC path {}", path.display())))?;
    // SAFETY: dlopen with a valid NUL-terminated path; the handle is intentionally
    // never closed, so symbols resolved through it stay valid.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_owned()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(EngineError::Model(format!(
            "cannot load NVRTC from {}: {why}",
            path.display()
        )));
    }
    Ok(())
}

/// `libnvrtc.so.12` under `dir` or its `nvidia/cuda_nvrtc/lib` (an unpacked wheel).
#[must_use]
pub fn find_in(dir: &Path) -> Option<PathBuf> {
    ["", "lib", "nvidia/cuda_nvrtc/lib"]
        .iter()
        .map(|sub| dir.join(sub).join("libnvrtc.so.12"))
        .find(|p| p.is_file())
}

/// Makes NVRTC loadable: the library named by `PREHEAT_NVRTC_LIB` (a file, or a
/// directory holding an unpacked `nvidia-cuda-nvrtc-cu12` wheel) or found under one of
/// `dirs` is preloaded; otherwise the usual library search applies. Returns whether an
/// NVRTC library is now available.
pub fn ensure_loaded(dirs: &[PathBuf]) -> bool {
    let from_env = std::env::var_os("PREHEAT_NVRTC_LIB").map(PathBuf::from);
    let candidates = from_env
        .iter()
        .flat_map(|p| {
            if p.is_file() {
                Some(p.clone())
            } else {
                find_in(p)
            }
        })
        .chain(dirs.iter().filter_map(|d| find_in(d)));
    for lib in candidates {
        match preload(&lib) {
            Ok(()) => {
                tracing::debug!(lib = %lib.display(), "NVRTC preloaded");
                break;
            }
            Err(e) => tracing::warn!(error = %e, "NVRTC preload failed"),
        }
    }
    available()
}

/// Compiles [`SOURCE`] for `arch`: `compute_XY` gives PTX, `sm_XY` gives a cubin.
pub fn compile(arch: &str) -> Result<Image> {
    if !available() {
        return Err(EngineError::Model(
            "NVRTC library (libnvrtc.so.12) not found".into(),
        ));
    }
    let opts = CompileOptions {
        // The architecture goes in as a flag: cudarc's `arch` field wants a `&'static`
        // string, and the device's is only known at run time.
        options: vec![format!("--gpu-architecture={arch}")],
        // Kernels are accuracy-checked against the CPU backend: no flush-to-zero, but
        // fast exp in softmax/SiLU is within bf16 tolerance.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some("preheat_kernels.cu".into()),
        ..CompileOptions::default()
    };
    if let Some(real) = arch.strip_prefix("sm_") {
        return compile_cubin(&opts, real).map(Image::Cubin);
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| EngineError::Model(format!("NVRTC ({arch}): {}", describe(&e))))?;
    Ok(Image::Ptx(ptx.to_src()))
}

fn describe(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

/// cudarc returns PTX only; a cubin comes from the same program through the raw API.
fn compile_cubin(opts: &CompileOptions, real: &str) -> Result<Vec<u8>> {
    let err = |what: &str, r: sys::nvrtcResult| {
        EngineError::Model(format!("NVRTC {what} for sm_{real}: {r:?}"))
    };
    let src = std::ffi::CString::new(SOURCE).expect("kernel source has no NUL");
    let name = std::ffi::CString::new("preheat_kernels.cu").expect("no NUL");
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers are passed (counts 0, null arrays).
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(err("create", r));
    }
    let mut flags: Vec<String> = vec![format!("--gpu-architecture=sm_{real}")];
    for (f, v) in [
        ("--ftz", opts.ftz),
        ("--prec-div", opts.prec_div),
        ("--prec-sqrt", opts.prec_sqrt),
    ] {
        if let Some(v) = v {
            flags.push(format!("{f}={v}"));
        }
    }
    let cflags: Vec<std::ffi::CString> = flags
        .iter()
        .map(|f| std::ffi::CString::new(f.as_str()).expect("no NUL"))
        .collect();
    let ptrs: Vec<*const c_char> = cflags.iter().map(|c| c.as_ptr()).collect();
    let out = (|| {
        // SAFETY: `prog` was created above; `ptrs` point into `cflags`, alive here.
        let r = unsafe { sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(EngineError::Model(format!(
                "NVRTC compile for sm_{real}: {}",
                program_log(prog)
            )));
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled; `size` is a valid out-pointer.
        let r = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            return Err(err("cubin size", r));
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds exactly the `size` bytes NVRTC reported.
        let r = unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(err("cubin", r));
        }
        Ok(buf)
    })();
    // SAFETY: `prog` is a live program, destroyed once.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    out
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is a live program; out-pointers are valid.
    unsafe {
        if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS
            || size == 0
        {
            return "no log".into();
        }
        let mut buf = vec![0u8; size];
        if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast()) != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return "no log".into();
        }
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .to_owned()
    }
}

/// The kernel-cache key of the kernels built for `arch` under `driver`: the source's
/// digest stands in for the model (the kernels are model-independent), so an edited
/// kernel never loads a stale image.
#[must_use]
pub fn cache_key(arch: &str, driver: &str) -> KernelKey {
    KernelKey {
        model: format!(
            "kernels-{:016x}",
            xxhash_rust::xxh3::xxh3_64(SOURCE.as_bytes())
        ),
        backend: "cuda".into(),
        arch: arch.into(),
        driver: driver.into(),
    }
}

/// Where an image came from, for the start-up phase and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Cache,
    Compiled,
}

/// The image for `arch` from `cache` when present and intact, else compiled (and put
/// in the cache when there is one). A cache that cannot be written is logged, not
/// fatal: the compiled image still serves.
pub fn image_for(arch: &str, driver: &str, cache: Option<&KernelCache>) -> Result<(Image, Origin)> {
    let id = cache_key(arch, driver).id();
    if let Some(c) = cache {
        match c.get(&id) {
            Ok(Some(bytes)) => match Image::decode(&bytes) {
                Some(img) => return Ok((img, Origin::Cache)),
                None => tracing::warn!(%id, "kernel-cache entry is not an image; recompiling"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(%id, error = %e, "kernel cache unreadable; compiling"),
        }
    }
    let img = compile(arch)?;
    if let Some(c) = cache
        && let Err(e) = c.put(&id, &img.encode())
    {
        tracing::warn!(%id, error = %e, "kernel cache not written");
    }
    Ok((img, Origin::Compiled))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_round_trip_through_their_encoding() {
        for img in [
            Image::Ptx(".version 8.0".into()),
            Image::Cubin(vec![0x7f, b'E']),
        ] {
            assert_eq!(Image::decode(&img.encode()), Some(img));
        }
        assert_eq!(Image::decode(b""), None);
        assert_eq!(Image::decode(b"C"), None);
        assert_eq!(Image::decode(b"Xjunk"), None);
    }

    #[test]
    fn the_cache_key_follows_the_source() {
        let k = cache_key("sm_90", "550.54");
        assert!(k.id().starts_with("kernels-"), "{}", k.id());
        assert!(k.id().ends_with("--cuda--sm_90--550.54"), "{}", k.id());
    }
}
