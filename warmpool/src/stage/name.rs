//! The names of a staged model and of the files that stand for it in a staging
//! directory.

use std::path::{Path, PathBuf};

use super::EXTENSION;
use crate::{Error, Result};

/// A model name usable as a file name and a label suffix.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && !name.starts_with(['.', '-', '_'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "model name {name:?}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )))
    }
}

/// The default name of a model staged from `source`: its file name less extensions.
#[must_use]
pub fn default_name(source: &crate::fetch::Source) -> Option<String> {
    let f = source.file_name()?;
    let stem = f
        .trim_end_matches(".phpack")
        .trim_end_matches(".zst")
        .trim_end_matches(".preheat");
    let clean: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    validate_name(&clean).ok().map(|()| clean)
}

/// Where model `name` is published in `dir`.
#[must_use]
pub fn snapshot_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.{EXTENSION}"))
}

pub(super) fn side_path(dir: &Path, name: &str, what: &str) -> PathBuf {
    dir.join(format!(".{name}.stage.{what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fetch::Source;

    #[test]
    fn names() {
        assert!(validate_name("llama-1b.v2").is_ok());
        for bad in ["", ".x", "a/b", "a b", &"x".repeat(64)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            default_name(&Source::parse("http://h/SmolLM2 135M.phpack")).as_deref(),
            Some("SmolLM2-135M")
        );
        assert_eq!(
            default_name(&Source::parse("/m/llama-1b.preheat")).as_deref(),
            Some("llama-1b")
        );
    }
}
