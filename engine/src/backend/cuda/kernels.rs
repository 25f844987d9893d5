//! The kernels of `kernels.cu`, each behind a typed launcher whose parameters mirror
//! the kernel's C signature, names and types in order: `launchers_mirror_kernels_cu`
//! parses the `.cu` source and fails on any difference. What the types cannot say (that
//! every buffer holds every element the grid touches) is the caller's to uphold, so the
//! launchers are `unsafe fn`s and each call site says why it holds.
use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use super::dev;
use crate::Result;

/// The C type a launcher parameter stands for in `kernels.cu` (read by the signature
/// test).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) trait CParam {
    const C: &'static str;
}

impl CParam for &CudaSlice<f32> {
    const C: &'static str = "const float*";
}
impl CParam for &mut CudaSlice<f32> {
    const C: &'static str = "float*";
}
impl CParam for &CudaSlice<u32> {
    const C: &'static str = "const u32*";
}
impl CParam for &mut CudaSlice<u16> {
    const C: &'static str = "u16*";
}
/// An embedding table in its stored dtype (the kernel's name picks the element type).
impl CParam for &CudaSlice<u8> {
    const C: &'static str = "const T*";
}
impl CParam for &i32 {
    const C: &'static str = "int";
}
impl CParam for &f32 {
    const C: &'static str = "float";
}

/// Declares the kernels: a field and a launcher each, the list of names NVRTC must
/// export, and the signatures the test compares with `kernels.cu`.
macro_rules! kernels {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?); )*) => {
        /// The loaded kernels.
        pub(crate) struct Kernels {
            _module: Arc<CudaModule>,
            $( $name: CudaFunction, )*
        }

        impl Kernels {
            /// Looks every kernel up in `module`.
            pub(crate) fn load(module: Arc<CudaModule>) -> Result<Self> {
                Ok(Kernels {
                    $( $name: module.load_function(stringify!($name)).map_err(dev)?, )*
                    _module: module,
                })
            }

            $(
                $(#[$doc])*
                ///
                /// # Safety
                ///
                /// Every buffer holds every element the grid `cfg` touches (the kernel's
                /// comment in `kernels.cu` says how its grid maps to rows), and index
                /// buffers (tokens, positions, block tables, rows) hold only indices
                /// that are in range for the buffers they index.
                #[allow(clippy::too_many_arguments)]
                pub(crate) unsafe fn $name(
                    &self,
                    st: &CudaStream,
                    cfg: LaunchConfig,
                    $($arg: $ty),*
                ) -> Result<()> {
                    let mut b = st.launch_builder(&self.$name);
                    $( b.arg($arg); )*
                    // SAFETY: the arguments are the kernel's C signature in kernels.cu, in
                    // order and type (`launchers_mirror_kernels_cu` checks), and the
                    // caller vouches for their sizes and indices (this fn's contract).
                    unsafe { b.launch(cfg) }.map(|_| ()).map_err(dev)
                }
            )*
        }

        /// Every kernel, as NVRTC's output must export it.
        pub const NAMES: &[&str] = &[$( stringify!($name) ),*];

        /// Each launcher's parameters as (name, C type).
        #[cfg(test)]
        const SIGNATURES: &[(&str, &[(&str, &str)])] = &[
            $( (stringify!($name), &[ $( (stringify!($arg), <$ty as CParam>::C) ),* ]) ),*
        ];
    };
}

kernels! {
    /// Embedding rows of `tokens` from an f32 table, as f32: `out[t, h]`. Grid (t).
    fn embed_f32(table: &CudaSlice<u8>, tokens: &CudaSlice<u32>, out: &mut CudaSlice<f32>, h: &i32);
    /// As `embed_f32`, from an f16 table.
    fn embed_f16(table: &CudaSlice<u8>, tokens: &CudaSlice<u32>, out: &mut CudaSlice<f32>, h: &i32);
    /// As `embed_f32`, from a bf16 table.
    fn embed_bf16(table: &CudaSlice<u8>, tokens: &CudaSlice<u32>, out: &mut CudaSlice<f32>, h: &i32);
    /// `out[r] = w · x[r] / rms(x[r])`. Grid (rows), block 256.
    fn rms_norm(x: &CudaSlice<f32>, w: &CudaSlice<f32>, out: &mut CudaSlice<f32>, h: &i32, eps: &f32);
    /// Rotate-half RoPE in place. Grid (t, heads), block hd / 2.
    fn rope(x: &mut CudaSlice<f32>, positions: &CudaSlice<u32>, inv_freq: &CudaSlice<f32>, heads: &i32, hd: &i32);
    /// Adds a bias to each row. Grid (rows).
    fn add_bias(x: &mut CudaSlice<f32>, b: &CudaSlice<f32>, n: &i32);
    /// `x += y`, elementwise.
    fn add_inplace(x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: &i32);
    /// `gate = silu(gate) · up`, elementwise.
    fn silu_mul(gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: &i32);
    /// f32 → bf16 bits, for GEMMs on bf16 weights.
    fn f32_to_bf16(x: &CudaSlice<f32>, out: &mut CudaSlice<u16>, n: &i32);
    /// f32 → f16 bits, for GEMMs on f16 weights.
    fn f32_to_f16(x: &CudaSlice<f32>, out: &mut CudaSlice<u16>, n: &i32);
    /// Writes each token's K and V into its cache slot. Grid (t).
    fn kv_write(
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        k_cache: &mut CudaSlice<f32>,
        v_cache: &mut CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        seq_of: &CudaSlice<u32>,
        block_tables: &CudaSlice<u32>,
        bt_stride: &i32,
        bs: &i32,
        slot_elems: &i32,
    );
    /// Causal attention over the paged cache. Grid (t, nh), block 128, dynamic shared
    /// memory (hd + block + 32) floats.
    fn paged_attention(
        q: &CudaSlice<f32>,
        k_cache: &CudaSlice<f32>,
        v_cache: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        seq_of: &CudaSlice<u32>,
        block_tables: &CudaSlice<u32>,
        bt_stride: &i32,
        nh: &i32,
        nkv: &i32,
        hd: &i32,
        bs: &i32,
        scale: &f32,
    );
    /// The rows `rows` of `x`. Grid (rows).
    fn gather_rows(x: &CudaSlice<f32>, rows: &CudaSlice<u32>, out: &mut CudaSlice<f32>, h: &i32);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (name, C type) of each parameter in `params` (`const float* x, int h`).
    fn params(list: &str) -> Vec<(String, String)> {
        list.split(',')
            .map(|p| {
                let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                let cut = p
                    .rfind([' ', '*'])
                    .expect("a parameter has a type and a name");
                let (ty, name) = p.split_at(cut + 1);
                (name.to_owned(), ty.trim().replace(" *", "*"))
            })
            .collect()
    }

    /// Every `extern "C"` kernel of the source with its parameters; kernels made by the
    /// `EMBED` macro keep the macro's signature (`const T* table`).
    fn kernels_in(src: &str) -> Vec<(String, Vec<(String, String)>)> {
        let src = src.replace("\\\n", " ");
        let mut out = Vec::new();
        let mut embed = None;
        for piece in src.split("extern \"C\" __global__ void ").skip(1) {
            let open = piece.find('(').unwrap();
            let close = piece.find(')').unwrap();
            let name = piece[..open].trim().to_owned();
            let ps = params(&piece[open + 1..close]);
            if name == "NAME" {
                embed = Some(ps);
            } else {
                out.push((name, ps));
            }
        }
        let embed = embed.expect("the EMBED macro's signature");
        for line in src.lines() {
            if let Some(rest) = line.strip_prefix("EMBED(") {
                let name = rest.split(',').next().unwrap().trim().to_owned();
                out.push((name, embed.clone()));
            }
        }
        out
    }

    #[test]
    fn launchers_mirror_kernels_cu() {
        let cu = kernels_in(super::super::nvrtc::SOURCE);
        assert_eq!(
            cu.len(),
            SIGNATURES.len(),
            "kernels in kernels.cu vs launchers: {cu:?}"
        );
        for (name, rust) in SIGNATURES {
            let (_, c) = cu
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("no kernel {name} in kernels.cu"));
            let rust: Vec<(String, String)> = rust
                .iter()
                .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
                .collect();
            assert_eq!(
                &rust, c,
                "{name}: the launcher's parameters differ from kernels.cu"
            );
        }
    }

    #[test]
    fn the_signature_parser_sees_a_changed_parameter() {
        let cu = super::super::nvrtc::SOURCE.replace(
            "rms_norm(const float* x, const float* w, float* out, int h,",
            "rms_norm(const float* x, const float* w, float* out, float h,",
        );
        let parsed = kernels_in(&cu);
        let (_, rms) = parsed.iter().find(|(n, _)| n == "rms_norm").unwrap();
        assert_eq!(rms[3], ("h".to_owned(), "float".to_owned()));
    }
}
