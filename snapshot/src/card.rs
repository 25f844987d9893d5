//! A model's card: what a snapshot says about its model without its weights — the
//! manifest (config, generation defaults, chat template, tensor digests) and the
//! tokenizer. A gateway fronts a model with it and never maps a tensor; it can be read
//! from a local file or, a few ranges at a time, from wherever the snapshot is
//! published.

use crate::checksum::Checksum;
use crate::manifest::Manifest;
use crate::{Error, Result, Snapshot};

/// The manifest and tokenizer of one snapshot, checked against the manifest's digests.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCard {
    pub manifest: Manifest,
    /// `tokenizer.json`, when the snapshot has one.
    pub tokenizer_json: Option<Vec<u8>>,
}

impl ModelCard {
    /// A card from a manifest (already validated, e.g. by [`crate::parse_prefix`]) and
    /// the bytes read for its tokenizer blob; refuses bytes whose digest differs.
    pub fn new(manifest: Manifest, tokenizer_json: Option<Vec<u8>>) -> Result<Self> {
        match (&manifest.tokenizer, &tokenizer_json) {
            (Some(t), Some(bytes)) => {
                let actual = Checksum::of(bytes);
                if actual != t.blob.checksum || bytes.len() as u64 != t.blob.nbytes {
                    return Err(Error::ChecksumMismatch {
                        what: "tokenizer".into(),
                        expected: t.blob.checksum.to_string(),
                        actual: actual.to_string(),
                    });
                }
            }
            (Some(_), None) => {
                return Err(Error::InvalidManifest(
                    "the manifest names a tokenizer blob that was not read".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(Error::InvalidManifest(
                    "tokenizer bytes given for a snapshot without a tokenizer".into(),
                ));
            }
            (None, None) => {}
        }
        Ok(ModelCard {
            manifest,
            tokenizer_json,
        })
    }

    /// The card of an open snapshot (copies the tokenizer; touches no tensor).
    pub fn of(snap: &Snapshot) -> Result<Self> {
        Ok(ModelCard {
            manifest: snap.manifest().clone(),
            tokenizer_json: snap.tokenizer_json()?.map(<[u8]>::to_vec),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokenizer_that_does_not_match_its_digest_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.preheat");
        crate::synth::synthesize(
            "tiny",
            &path,
            crate::synth::SynthOptions::default(),
            &crate::NoProgress,
        )
        .unwrap();
        let snap = Snapshot::open(&path).unwrap();
        let card = ModelCard::of(&snap).unwrap();
        let again = ModelCard::new(card.manifest.clone(), card.tokenizer_json.clone()).unwrap();
        assert_eq!(again, card);
        let mut bad = card.tokenizer_json.clone().unwrap();
        bad[0] ^= 1;
        let e = ModelCard::new(card.manifest.clone(), Some(bad)).unwrap_err();
        assert!(e.to_string().contains("tokenizer"), "{e}");
        assert!(ModelCard::new(card.manifest, None).is_err());
    }
}
