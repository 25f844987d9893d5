//! `preheat snapshot …`

use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use preheat_output::Bar;
use preheat_output::outln;
use preheat_output::{emit, human_bytes, print_json};
use preheat_snapshot::packed::{self, PackOptions};
use preheat_snapshot::synth::{self, SynthOptions};
use preheat_snapshot::{DType, Snapshot, TargetDtype, WriteSummary};
use serde_json::json;

use super::default_threads;
use crate::cli::SnapshotCmd;

pub fn run(cmd: SnapshotCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        SnapshotCmd::Convert {
            src,
            output,
            dtype,
            out,
        } => {
            let target: TargetDtype = dtype.as_str().parse()?;
            let t = Instant::now();
            let s = preheat_snapshot::convert(&src, &output, target, &Bar::new())
                .with_context(|| format!("converting {}", src.display()))?;
            report_written(&s, t.elapsed().as_secs_f64(), out.json)?;
        }
        SnapshotCmd::Inspect { file, out } => {
            let snap = Snapshot::open(&file)?;
            inspect(&snap, out.json)?;
        }
        SnapshotCmd::Verify { file, threads, out } => {
            let snap = Snapshot::open(&file)?;
            let t = Instant::now();
            let report = snap.verify(default_threads(threads))?;
            let secs = t.elapsed().as_secs_f64();
            let ok = report.mismatches.is_empty();
            if out.json {
                print_json(&json!({
                    "ok": ok, "items": report.items, "bytes": report.bytes, "seconds": secs,
                    "corrupt": report.mismatches.iter().map(|m| json!({"name": m.name,
                        "expected": m.expected.to_string(), "actual": m.actual.to_string()})).collect::<Vec<_>>(),
                }))?;
            } else if ok {
                outln!(
                    "ok: {} checksums over {} verified in {secs:.2} s ({:.2} GB/s)",
                    report.items,
                    human_bytes(report.bytes),
                    report.bytes as f64 / secs / 1e9
                );
            } else {
                for m in &report.mismatches {
                    outln!(
                        "corrupt: {} (expected {}, computed {})",
                        m.name,
                        m.expected,
                        m.actual
                    );
                }
            }
            if !ok {
                eprintln!(
                    "error: {} corrupt item(s) in {}",
                    report.mismatches.len(),
                    file.display()
                );
                return Ok(ExitCode::from(1));
            }
        }
        SnapshotCmd::Pack {
            file,
            output,
            level,
            chunk_mib,
            no_byte_planes,
            threads,
            out,
        } => {
            let opts = PackOptions {
                chunk_size: chunk_mib
                    .checked_mul(1 << 20)
                    .context("--chunk-mib too large")?,
                level,
                threads: default_threads(threads),
                byte_planes: !no_byte_planes,
            };
            let t = Instant::now();
            let s = packed::pack(&file, &output, opts, &Bar::new())?;
            let secs = t.elapsed().as_secs_f64();
            if out.json {
                print_json(
                    &json!({"original_len": s.original_len, "packed_len": s.packed_len,
                    "chunks": s.chunks, "ratio": s.ratio(), "seconds": secs}),
                )?;
            } else {
                outln!(
                    "packed {} → {} ({:.3}×, {} chunks) in {secs:.2} s",
                    human_bytes(s.original_len),
                    human_bytes(s.packed_len),
                    s.ratio(),
                    s.chunks
                );
            }
        }
        SnapshotCmd::Unpack {
            packed: src,
            output,
            threads,
            out,
        } => {
            let t = Instant::now();
            let s = packed::unpack(&src, &output, default_threads(threads), &Bar::new())?;
            let secs = t.elapsed().as_secs_f64();
            if out.json {
                print_json(&json!({"original_len": s.original_len, "chunks": s.chunks,
                    "resumed_chunks": s.resumed_chunks, "seconds": secs}))?;
            } else {
                outln!(
                    "unpacked {} ({} chunks, {} resumed) to {} in {secs:.2} s",
                    human_bytes(s.original_len),
                    s.chunks,
                    s.resumed_chunks,
                    output.display()
                );
            }
        }
        SnapshotCmd::Synth {
            preset,
            output,
            dtype,
            seed,
            out,
        } => {
            let opts = SynthOptions {
                dtype: dtype.as_str().parse::<DType>()?,
                seed,
                ..SynthOptions::default()
            };
            let t = Instant::now();
            let s = synth::synthesize(&preset, &output, opts, &Bar::new())?;
            report_written(&s, t.elapsed().as_secs_f64(), out.json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Reports a freshly written snapshot (convert, synth).
fn report_written(s: &WriteSummary, secs: f64, as_json: bool) -> anyhow::Result<()> {
    if as_json {
        print_json(
            &json!({"path": s.path, "file_len": s.file_len, "tensors": s.tensors,
            "tensor_bytes": s.tensor_bytes, "seconds": secs}),
        )
    } else {
        outln!(
            "wrote {}: {} tensors, {} in {secs:.2} s",
            s.path.display(),
            s.tensors,
            human_bytes(s.file_len)
        );
        Ok(())
    }
}

fn inspect(snap: &Snapshot, as_json: bool) -> anyhow::Result<()> {
    let m = snap.manifest();
    if as_json {
        let tensors: Vec<_> = m
            .tensors
            .iter()
            .map(|t| {
                json!({"name": t.name, "dtype": t.dtype, "shape": t.shape,
                "offset": t.offset, "nbytes": t.nbytes, "checksum": t.checksum.to_string()})
            })
            .collect();
        return print_json(&json!({
            "path": snap.path(),
            "format_version": m.format_version,
            "file_len": snap.file_len(),
            "data_offset": snap.header().data_offset,
            "tensor_bytes": snap.tensor_bytes(),
            "model": m.model,
            "generation": m.generation,
            "source": m.source,
            "chat_template": m.chat_template,
            "tool_use_template": m.tool_use_template,
            "tokenizer": m.tokenizer,
            "kernel_cache": m.kernel_cache,
            "tensors": tensors,
        }));
    }
    let mut o = String::new();
    macro_rules! w {
        ($($a:tt)*) => {{
            use std::fmt::Write as _;
            let _ = writeln!(o, $($a)*);
        }};
    }
    let c = &m.model;
    w!(
        "{} (format v{}, {})",
        snap.path().display(),
        m.format_version,
        human_bytes(snap.file_len())
    );
    w!("  source        {} {}", m.source.kind, m.source.name);
    w!(
        "  model         {:?}: {} layers, hidden {}, ffn {}, heads {}/{} × {}, vocab {}",
        c.architecture,
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size
    );
    w!(
        "  rope          theta {}{}; tied embeddings: {}; qkv bias: {}",
        c.rope_theta,
        c.rope_scaling
            .as_ref()
            .map(|s| format!(", scaling {s:?}"))
            .unwrap_or_default(),
        c.tie_word_embeddings,
        c.attention_bias
    );
    w!(
        "  tokenizer     {}; chat template: {}",
        m.tokenizer
            .as_ref()
            .map_or("none".into(), |t| human_bytes(t.blob.nbytes)),
        match (&m.chat_template, &m.tool_use_template) {
            (Some(_), Some(_)) => "yes, and one for chats with tools",
            (Some(_), None) => "yes",
            (None, _) => "no",
        }
    );
    w!(
        "  tensors       {} ({})",
        m.tensors.len(),
        human_bytes(snap.tensor_bytes())
    );
    w!("");
    w!(
        "  {:<52} {:>5} {:>18} {:>14} {:>12}",
        "name",
        "dtype",
        "shape",
        "offset",
        "bytes"
    );
    for t in &m.tensors {
        w!(
            "  {:<52} {:>5} {:>18} {:>14} {:>12}",
            t.name,
            t.dtype,
            format!("{:?}", t.shape),
            t.offset,
            t.nbytes
        );
    }
    emit(&o)
}
