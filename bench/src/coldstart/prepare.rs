//! What the starts begin from: the snapshot (made once), and for the `convert` source
//! the checkpoint files served over local HTTP as a model hub would.

use super::*;

/// The snapshot to start from and the files a replica without preheat downloads.
pub(super) struct Prepared {
    pub(super) name: String,
    pub(super) snapshot: PathBuf,
    /// Directory served over HTTP, and the files in it a replica fetches.
    pub(super) convert_dir: PathBuf,
    pub(super) convert_files: Vec<String>,
    /// The downloaded form is a directory (HF) rather than one file (GGUF).
    pub(super) convert_is_dir: bool,
}

/// The snapshot of `model` (a synthetic preset, a .preheat, or a checkpoint converted
/// once) in `work`: its name, path, and the path `model` names.
pub(crate) fn snapshot_for(model: &str, work: &Path) -> anyhow::Result<(String, PathBuf, PathBuf)> {
    std::fs::create_dir_all(work)?;
    let bar = preheat_output::progress_bar::Bar::new();
    let as_path = PathBuf::from(model);
    let preset = preheat_snapshot::synth::PRESETS.contains(&model) && !as_path.exists();
    let name = if preset {
        model.to_owned()
    } else {
        preheat_engine::colocated::default_name(&as_path)
    };
    let snapshot = if as_path.extension().is_some_and(|e| e == "preheat") {
        as_path.clone()
    } else {
        work.join(format!("{name}.preheat"))
    };
    if !snapshot.exists() {
        if preset {
            tracing::info!(preset = model, "writing the synthetic snapshot (once)");
            preheat_snapshot::synth::synthesize(
                model,
                &snapshot,
                preheat_snapshot::synth::SynthOptions::default(),
                &bar,
            )?;
        } else {
            preheat_snapshot::convert(
                &as_path,
                &snapshot,
                preheat_snapshot::TargetDtype::Keep,
                &bar,
            )?;
        }
    }
    Ok((name, snapshot, as_path))
}

pub(super) fn prepare(model: &str, work: &Path) -> anyhow::Result<Prepared> {
    let (name, snapshot, as_path) = snapshot_for(model, work)?;
    let is_gguf = as_path.extension().is_some_and(|e| e == "gguf");
    if is_gguf {
        let dir = as_path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let file = as_path
            .file_name()
            .context("GGUF path has no file name")?
            .to_string_lossy()
            .into_owned();
        return Ok(Prepared {
            name,
            snapshot,
            convert_dir: dir,
            convert_files: vec![file],
            convert_is_dir: false,
        });
    }
    let hf = if as_path.is_dir() {
        as_path
    } else {
        let hf = work.join(format!("{name}-hf"));
        if !hf.join("model.safetensors").exists() {
            tracing::info!(dir = %hf.display(), "exporting a Hugging Face checkpoint (once)");
            let snap = preheat_snapshot::Snapshot::open(&snapshot)?;
            preheat_snapshot::source::hf::export(&snap, &hf)?;
        }
        hf
    };
    let mut files: Vec<String> = std::fs::read_dir(&hf)?
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    files.sort();
    Ok(Prepared {
        name,
        snapshot,
        convert_dir: hf,
        convert_files: files,
        convert_is_dir: true,
    })
}

/// Serves `dir` over HTTP on a background thread; returns the base URL.
pub(super) fn serve_dir(dir: PathBuf) -> anyhow::Result<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return;
            }
        };
        rt.block_on(async move {
            let dir = Arc::new(dir);
            let app =
                axum::Router::new().route(
                    "/{file}",
                    axum::routing::get(
                        move |axum::extract::Path(file): axum::extract::Path<String>,
                              headers: axum::http::HeaderMap| {
                            let dir = Arc::clone(&dir);
                            async move {
                                preheat_warmpool::files::serve_file(&dir, &file, &headers).await
                            }
                        },
                    ),
                );
            match tokio::net::TcpListener::bind("127.0.0.1:0").await {
                Ok(l) => {
                    let addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
                    let _ = tx.send(Ok(format!("http://{addr}")));
                    let _ = axum::serve(l, app).await;
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string()));
                }
            }
        });
    });
    rx.recv()?.map_err(|e| anyhow::anyhow!("file server: {e}"))
}
