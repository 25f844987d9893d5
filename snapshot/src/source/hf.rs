//! Hugging Face checkpoint directories: `config.json`, `generation_config.json`,
//! `tokenizer.json`, `tokenizer_config.json` / `chat_template.jinja`, and safetensors
//! weights in one file or sharded with `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;

use super::{ModelSource, TargetDtype, source_info};
use crate::config::{GenerationDefaults, ModelConfig};
use crate::dtype::convert_into;
use crate::writer::{SnapshotBuilder, TensorSpec, TokenizerData};
use crate::{DType, Error, Result};

/// Where a tensor's bytes are: shard index and byte range within that shard's map.
#[derive(Debug)]
struct StTensor {
    shard: usize,
    dtype: DType,
    shape: Vec<u64>,
    range: std::ops::Range<usize>,
}

/// An opened HF checkpoint with its safetensors shards mapped.
#[derive(Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Mmap>,
    tensors: BTreeMap<String, StTensor>,
    /// File order of tensor names (shard order, then header order).
    order: Vec<String>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_slice(&text)
        .map_err(|e| Error::InvalidSource(format!("{}: {e}", path.display())))
}

fn st_dtype(d: StDtype, name: &str) -> Result<DType> {
    match d {
        StDtype::F32 => Ok(DType::F32),
        StDtype::F16 => Ok(DType::F16),
        StDtype::BF16 => Ok(DType::BF16),
        other => Err(Error::Unsupported(format!(
            "tensor {name} has dtype {other:?} (f32, f16, bf16 are supported)"
        ))),
    }
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_hf_json(&read_json(&dir.join("config.json"))?)?;
        let index = dir.join("model.safetensors.index.json");
        let shard_names: Vec<String> = if index.exists() {
            let v = read_json(&index)?;
            let map = v["weight_map"].as_object().ok_or_else(|| {
                Error::InvalidSource(format!("{}: no weight_map object", index.display()))
            })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect();
            names.sort();
            names.dedup();
            names
        } else {
            vec!["model.safetensors".to_owned()]
        };
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        let mut order = Vec::new();
        for name in shard_names {
            if name.contains('/') || name.contains("..") {
                return Err(Error::InvalidSource(format!(
                    "shard name {name:?} leaves the directory"
                )));
            }
            let path = dir.join(&name);
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: read-only map of a checkpoint file that is not modified while the
            // conversion runs (the same assumption every safetensors loader makes).
            #[allow(unsafe_code)]
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| Error::InvalidSource(format!("{}: {e}", path.display())))?;
            let mut names: Vec<(usize, String)> = st
                .tensors()
                .into_iter()
                .map(|(n, v)| (v.data().as_ptr() as usize, n))
                .collect();
            names.sort();
            for (_, n) in names {
                // Rotary caches saved by old checkpoints are recomputed, not weights.
                if n.ends_with("rotary_emb.inv_freq") {
                    continue;
                }
                let v = st
                    .tensor(&n)
                    .map_err(|e| Error::InvalidSource(format!("{n}: {e}")))?;
                let start = v.data().as_ptr() as usize - map.as_ptr() as usize;
                let t = StTensor {
                    shard: shards.len(),
                    dtype: st_dtype(v.dtype(), &n)?,
                    shape: v.shape().iter().map(|&d| d as u64).collect(),
                    range: start..start + v.data().len(),
                };
                if tensors.insert(n.clone(), t).is_some() {
                    return Err(Error::InvalidSource(format!("tensor {n} in two shards")));
                }
                order.push(n);
            }
            shards.push(map);
        }
        let ck = HfCheckpoint {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensors,
            order,
        };
        ck.check_tensors()?;
        Ok(ck)
    }

    /// Every tensor the engine will look up exists with the shape the config implies.
    fn check_tensors(&self) -> Result<()> {
        let want = crate::tensors::all(&self.config, self.tied());
        let mut errs = Vec::new();
        for (name, shape) in want {
            match self.tensors.get(&name) {
                None => errs.push(format!("missing tensor {name}")),
                Some(t) if t.shape != shape => errs.push(format!(
                    "tensor {name} has shape {:?}, config implies {shape:?}",
                    t.shape
                )),
                Some(_) => {}
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(Error::InvalidConfig(errs))
        }
    }

    /// Tied when the config says so or when the checkpoint simply has no `lm_head`.
    fn tied(&self) -> bool {
        self.config.tie_word_embeddings || !self.tensors.contains_key("lm_head.weight")
    }

    /// The tokenizer, the chat template and the `tool_use` template (if any).
    fn tokenizer(&self) -> Result<(Option<TokenizerData>, Option<String>, Option<String>)> {
        let tok_path = self.dir.join("tokenizer.json");
        let tc_path = self.dir.join("tokenizer_config.json");
        let tc = if tc_path.exists() {
            read_json(&tc_path)?
        } else {
            Value::Null
        };
        let special = |k: &str| match &tc[k] {
            Value::String(s) => Some(s.clone()),
            Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
            _ => None,
        };
        let tokenizer = if tok_path.exists() {
            let json = std::fs::read(&tok_path).map_err(|e| Error::io(&tok_path, e))?;
            serde_json::from_slice::<Value>(&json)
                .map_err(|e| Error::InvalidSource(format!("{}: {e}", tok_path.display())))?;
            Some(TokenizerData {
                json,
                bos_token: special("bos_token"),
                eos_token: special("eos_token"),
                add_bos_token: tc["add_bos_token"].as_bool().unwrap_or(false),
            })
        } else {
            None
        };
        // chat_template.jinja wins over the (older) string or named list in
        // tokenizer_config.json, as in transformers; a named `tool_use` template
        // (in the list, or additional_chat_templates/tool_use.jinja) renders chats
        // that offer tools.
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| Error::io(p, e));
        let named = |name: &str| match &tc["chat_template"] {
            Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == name)
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            _ => None,
        };
        let jinja = self.dir.join("chat_template.jinja");
        let template = if jinja.exists() {
            Some(read(&jinja)?)
        } else {
            match &tc["chat_template"] {
                Value::String(s) => Some(s.clone()),
                Value::Array(list) => named("default").or_else(|| {
                    list.first()
                        .and_then(|t| t["template"].as_str())
                        .map(str::to_owned)
                }),
                _ => None,
            }
        };
        let tool_jinja = self.dir.join("additional_chat_templates/tool_use.jinja");
        let tool_use = if tool_jinja.exists() {
            Some(read(&tool_jinja)?)
        } else {
            named("tool_use")
        };
        Ok((tokenizer, template, tool_use))
    }
}

impl ModelSource for HfCheckpoint {
    fn builder(&self, target: TargetDtype) -> Result<SnapshotBuilder> {
        let mut config = self.config.clone();
        config.tie_word_embeddings = self.tied();
        let mut b = SnapshotBuilder::new(config, source_info("hf", &self.dir));
        let gen_path = self.dir.join("generation_config.json");
        if gen_path.exists() {
            b.generation = GenerationDefaults::from_hf_json(&read_json(&gen_path)?);
        }
        (b.tokenizer, b.chat_template, b.tool_use_template) = self.tokenizer()?;
        for name in &self.order {
            let t = &self.tensors[name];
            if name == "lm_head.weight" && self.config.tie_word_embeddings {
                continue;
            }
            b.tensors.push(TensorSpec {
                name: name.clone(),
                dtype: match target {
                    TargetDtype::Keep => t.dtype,
                    TargetDtype::To(d) => d,
                },
                shape: t.shape.clone(),
            });
        }
        b.tensors.sort_by_key(|s| super::engine_order(&s.name));
        Ok(b)
    }

    fn read_tensor(&self, spec: &TensorSpec, out: &mut Vec<u8>) -> Result<()> {
        let t = self
            .tensors
            .get(&spec.name)
            .ok_or_else(|| Error::NoSuchTensor(spec.name.clone()))?;
        convert_into(
            &self.shards[t.shard][t.range.clone()],
            t.dtype,
            spec.dtype,
            out,
        )
    }
}

/// One tensor of a snapshot as a safetensors view (borrowed from the mapping).
struct ExportView<'a> {
    dtype: StDtype,
    shape: Vec<usize>,
    bytes: &'a [u8],
}

impl safetensors::View for ExportView<'_> {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `snap` as a Hugging Face checkpoint directory (`config.json`,
/// `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`): what a replica
/// without preheat would download, for benchmarks and for interoperability.
pub fn export(snap: &crate::Snapshot, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let m = snap.manifest();
    let write_json = |name: &str, v: &Value| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_vec_pretty(v).unwrap_or_default())
            .map_err(|e| Error::io(&p, e))
    };
    write_json("config.json", &m.model.to_hf_json()?)?;
    let mut views = Vec::with_capacity(m.tensors.len());
    for t in snap.tensors() {
        let dtype = match t.dtype() {
            DType::F32 => StDtype::F32,
            DType::F16 => StDtype::F16,
            DType::BF16 => StDtype::BF16,
        };
        let shape = t
            .shape()
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| Error::Unsupported(format!("tensor {} is too large", t.name())))?;
        views.push((
            t.name().to_owned(),
            ExportView {
                dtype,
                shape,
                bytes: t.bytes(),
            },
        ));
    }
    let st = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &st)
        .map_err(|e| Error::InvalidSource(format!("{}: {e}", st.display())))?;
    if let Some(t) = &m.tokenizer {
        let json = snap.tokenizer_json()?.unwrap_or_default();
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, json).map_err(|e| Error::io(&p, e))?;
        let mut tc = serde_json::json!({"add_bos_token": t.add_bos_token});
        if let Some(b) = &t.bos_token {
            tc["bos_token"] = Value::String(b.clone());
        }
        if let Some(e) = &t.eos_token {
            tc["eos_token"] = Value::String(e.clone());
        }
        if let Some(ct) = &m.chat_template {
            tc["chat_template"] = Value::String(ct.clone());
        }
        write_json("tokenizer_config.json", &tc)?;
    }
    Ok(())
}
