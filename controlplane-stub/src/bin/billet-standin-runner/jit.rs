//! The emulator's JIT config, decoded without ever echoing it.

use base64::Engine as _;
use scaleset::{RunnerId, ScaleSetId};
use serde::Deserialize;

/// The emulator's decoded JIT config.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JitConfig {
    pub(crate) runner_id: RunnerId,
    pub(crate) runner_name: String,
    pub(crate) scale_set_id: ScaleSetId,
    pub(crate) emulator: String,
}

impl JitConfig {
    /// Decodes the config without ever echoing it: errors say what is wrong, not what is there.
    pub(crate) fn decode(encoded: &str) -> Result<Self, String> {
        let json = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|_| "the JIT config is not base64".to_owned())?;
        let config: Self = serde_json::from_slice(&json).map_err(|e| {
            // serde's message may quote a value from the config; only a missing field is safe.
            let what = e.to_string();
            let what = match what.split_once(" at line") {
                Some((missing, _)) if missing.starts_with("missing field") => missing.to_owned(),
                _ => format!(
                    "{:?} error at line {} column {}",
                    e.classify(),
                    e.line(),
                    e.column()
                ),
            };
            format!(
                "the JIT config is not the scaleset emulator's \
                 (base64 of JSON with runnerId, runnerName, scaleSetId, emulator): {what}"
            )
        })?;
        if !config.emulator.starts_with("http://") {
            return Err("the JIT config's emulator is not an http:// URL".to_owned());
        }
        if config.runner_name.is_empty() {
            return Err("the JIT config has an empty runnerName".to_owned());
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(json: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(json)
    }

    #[test]
    fn the_emulators_jit_config_decodes() {
        let config = JitConfig::decode(&encode(
            r#"{"runnerId":1002,"runnerName":"billet-7","scaleSetId":1001,"emulator":"http://127.0.0.1:4100"}"#,
        ))
        .unwrap();
        assert_eq!(config.runner_id, RunnerId(1002));
        assert_eq!(config.runner_name, "billet-7");
        assert_eq!(config.scale_set_id, ScaleSetId(1001));
    }

    #[test]
    fn a_malformed_jit_config_is_refused_without_echoing_it() {
        let secret = "s3cr3t-token-value";
        for (encoded, says) in [
            (secret.to_owned(), "not base64"),
            (encode(secret), "not the scaleset emulator's"),
            (
                encode(&format!(
                    r#"{{"runnerId":"{secret}","runnerName":"r","scaleSetId":1,"emulator":"http://e"}}"#
                )),
                "Data error",
            ),
            (
                encode(&format!(
                    r#"{{"runnerName":"{secret}","scaleSetId":1,"emulator":"http://e"}}"#
                )),
                "missing field `runnerId`",
            ),
            (
                encode(&format!(
                    r#"{{"runnerId":1,"runnerName":"r","scaleSetId":1,"emulator":"{secret}"}}"#
                )),
                "not an http:// URL",
            ),
        ] {
            let err = JitConfig::decode(&encoded).unwrap_err();
            assert!(err.contains(says), "{err}");
            assert!(!err.contains("s3cr3t"), "{err}");
        }
    }
}
