//! The models `up` serves: named from `--model [NAME=]PATH` (a DNS label, the file's
//! stem by default), each staged, measured and read for the gateway, and all of them
//! given to the warm-pool agent.

use super::*;

/// One model `up` serves: its name and where it comes from (`None`: the embedded one).
#[derive(Clone, Debug)]
pub(super) struct ModelArg {
    pub(super) name: String,
    pub(super) path: Option<PathBuf>,
}

/// `--model [NAME=]PATH` as a [`ModelArg`]: the part before the first `=` is a name
/// when it is a DNS label (a path with `=` in it keeps it: `./a=b` names nothing).
pub(super) fn model_arg(arg: &str) -> ModelArg {
    if let (Some(name), path) = preheat_flags::split_named(arg, is_dns_label) {
        return ModelArg {
            name: name.to_owned(),
            path: Some(PathBuf::from(path)),
        };
    }
    let path = PathBuf::from(arg);
    let stem = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    ModelArg {
        name: dns_label(&stem),
        path: Some(path),
    }
}

/// Whether `s` is a DNS label (RFC 1123): what a model's name must be, since it names
/// its pools' objects in a cluster too.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `s` made a DNS label: lower case, every run of other characters one `-`, at most
/// 63 characters (`SmolLM2-135M-Instruct.Q4_1` → `smollm2-135m-instruct-q4-1`).
fn dns_label(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    out.truncate(63);
    let out = out.trim_end_matches('-').to_owned();
    if out.is_empty() {
        "model".to_owned()
    } else {
        out
    }
}

/// The warm-pool agent's view of this machine: every model, staged into
/// `<cache>/node` and kept hot, with the kernel cache beside them.
pub(super) fn agent_config(o: &Options, served: &[Served]) -> anyhow::Result<AgentConfig> {
    let mut bytes = 0u64;
    for s in served {
        bytes = bytes.saturating_add(std::fs::metadata(&s.source)?.len());
    }
    Ok(AgentConfig {
        dir: o.cache.join("node"),
        disk_budget: bytes.saturating_mul(4).max(1 << 30),
        memory_budget: bytes.saturating_mul(2).max(256 << 20),
        listen: o.agent,
        refresh: Duration::from_secs(5),
        kernel_cache_dir: Some(o.cache.join("kernels")),
        models: served
            .iter()
            .map(|s| ModelSpec {
                name: s.staged.clone(),
                source: preheat_warmpool::Source::Path(s.source.clone()),
                hot: true,
            })
            .collect(),
        ..AgentConfig::default()
    })
}

/// A model as `up` serves it: staged, measured, and read for the gateway.
pub(super) struct Served {
    pub(super) name: String,
    /// The snapshot staged from its source.
    pub(super) source: PathBuf,
    /// Its measured capacity profile.
    pub(super) profile: Profile,
    /// Where it lies (the scaler reads it from there).
    pub(super) profile_path: PathBuf,
    pub(super) info: preheat_engine::disagg::ModelInfo,
    /// Its name in the warm pool (name and manifest digest).
    pub(super) staged: String,
}

impl Served {
    pub(super) fn prepare(o: &Options, m: &ModelArg) -> anyhow::Result<Served> {
        let source = stage(o, m)?;
        let (profile_path, profile) = measured_profile(&source, o.kv_cache_mib)?;
        Ok(Served {
            profile,
            profile_path,
            info: gateway::model_info(&source, 16, Some(&m.name))?,
            staged: staged_name(&m.name, &source)?,
            name: m.name.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_models_name_defaults_to_its_files_stem_made_a_dns_label() {
        let m = model_arg("/models/SmolLM2-135M-Instruct.Q4_1.gguf");
        assert_eq!(m.name, "smollm2-135m-instruct-q4-1");
        assert_eq!(dns_label("__Odd..Name__"), "odd-name");
        assert_eq!(dns_label("..."), "model");
        assert_eq!(dns_label(&"x".repeat(80)).len(), 63);
    }

    #[test]
    fn set_takes_each_models_policy_keys_by_its_place() {
        assert_eq!(
            policy_override_problem("models.1.decode.headroom=1.2", 2),
            None
        );
        let e = policy_override_problem("models.2.decode.headroom=1.2", 2).unwrap();
        assert!(
            e.contains("serves 2 model(s)") && e.contains("2 names none"),
            "{e}"
        );
        let e = policy_override_problem("models.1.prefill.max_replicas=4", 2).unwrap();
        assert!(e.contains("--prefill-max"), "{e}");
        let e = policy_override_problem("models.0.name=x", 1).unwrap();
        assert!(e.contains("only the pools' policy keys"), "{e}");
    }

    #[test]
    fn name_equals_path_names_the_model_and_a_path_with_an_equals_sign_does_not() {
        let m = model_arg("chat=/models/a.preheat");
        assert_eq!(
            (m.name.as_str(), m.path.as_deref()),
            ("chat", Some(Path::new("/models/a.preheat")))
        );
        // Not a DNS label before the `=`: the whole argument is the path.
        let m = model_arg("./dir/a=b.preheat");
        assert_eq!(m.path.as_deref(), Some(Path::new("./dir/a=b.preheat")));
        assert_eq!(m.name, "a-b");
    }
}
