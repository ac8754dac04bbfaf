//! Registry mirrors for guests: the pull-through mirrors the node's
//! configuration names (`--registry-mirror URL`, repeatable;
//! `BILLET_REGISTRY_MIRRORS`, comma-separated; `registry_mirror` in the
//! configuration file), handed to every guest the node starts. A guest that
//! runs Docker reads them from its daemon configuration: the node writes
//! `{"registry-mirrors": [...]}` once at start-up into its state directory
//! ([`GuestMirrors::prepare`]) and the Docker provider binds that file
//! read-only at [`GUEST_DAEMON_JSON`] in each container; every guest also
//! gets them, comma-separated and in the configured order, in
//! [`MIRRORS_ENV`]. With none configured a guest gets neither.
//!
//! Image pulls the node itself makes (the runner image) are the engine's:
//! its own `registry-mirrors` are the operator's to set.
//!
//! May not touch: lease state, the journal, the plane.

use std::path::{Path, PathBuf};

/// The environment variable a guest finds the mirrors in, comma-separated.
pub(crate) const MIRRORS_ENV: &str = "BILLET_REGISTRY_MIRRORS";
/// Where a guest finds the Docker daemon configuration naming the mirrors.
pub(crate) const GUEST_DAEMON_JSON: &str = "/etc/docker/daemon.json";
/// The file under the state directory the node writes that configuration
/// to, bound into every guest.
pub(crate) const DAEMON_JSON_FILE: &str = "guest-docker-daemon.json";

/// Checks one `--registry-mirror` value: an `http://` or `https://` URL
/// with a host, no credentials (they would reach every guest's environment),
/// no query and no fragment. Answers it as given, trimmed.
///
/// # Errors
///
/// A sentence saying what is wrong and what is expected (clap names the
/// flag beside it).
pub(crate) fn parse_mirror(value: &str) -> Result<String, String> {
    let value = value.trim();
    let url = reqwest::Url::parse(value)
        .map_err(|e| format!("{value:?} is not a URL ({e}); give a registry mirror such as https://mirror.example:5000"))?;
    if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
        return Err(format!(
            "{value:?} is not an http:// or https:// URL with a host; give a registry mirror such as https://mirror.example:5000"
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(
            "a registry mirror URL must not carry credentials: it is handed to every guest"
                .to_owned(),
        );
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "{value:?} has a query or a fragment; a registry mirror is a scheme, host, port and path"
        ));
    }
    Ok(value.to_owned())
}

/// The mirrors every guest is given, with the daemon configuration file
/// written for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GuestMirrors {
    urls: Vec<String>,
    daemon_json: Option<PathBuf>,
}

impl GuestMirrors {
    /// Writes the daemon configuration for `urls` (checked by
    /// [`parse_mirror`]) to [`DAEMON_JSON_FILE`] in `state_dir`, readable
    /// by all (it holds no secret; a guest's user reads it through the
    /// bind), renamed into place. With no mirrors, removes a file an earlier
    /// configuration left and answers none.
    ///
    /// # Errors
    ///
    /// The file cannot be written or removed.
    pub(crate) fn prepare(state_dir: &Path, urls: Vec<String>) -> std::io::Result<Self> {
        let path = state_dir.join(DAEMON_JSON_FILE);
        if urls.is_empty() {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            return Ok(Self::default());
        }
        use std::io::Write as _;
        use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
        let tmp = state_dir.join(format!(".{DAEMON_JSON_FILE}.new"));
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
        file.write_all(daemon_json(&urls).as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        Ok(Self {
            urls,
            daemon_json: Some(path),
        })
    }

    /// The daemon configuration file on this host, when there are mirrors.
    pub(crate) fn daemon_json(&self) -> Option<&Path> {
        self.daemon_json.as_deref()
    }

    /// The value of [`MIRRORS_ENV`], when there are mirrors.
    pub(crate) fn env_value(&self) -> Option<String> {
        (!self.urls.is_empty()).then(|| self.urls.join(","))
    }
}

/// A Docker daemon configuration naming `urls` as its registry mirrors.
pub(crate) fn daemon_json(urls: &[String]) -> String {
    let mut text = serde_json::to_string_pretty(&serde_json::json!({ "registry-mirrors": urls }))
        .unwrap_or_default();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_is_an_http_or_https_url_with_a_host_and_no_credentials() {
        for good in [
            "https://mirror.gcr.io",
            "http://10.0.0.5:5000",
            " https://registry.example/mirror/ ",
        ] {
            assert_eq!(parse_mirror(good).as_deref(), Ok(good.trim()));
        }
        for (bad, says) in [
            ("mirror.example", "is not a URL"),
            ("ftp://mirror.example", "http:// or https://"),
            ("unix:///run/registry.sock", "http:// or https://"),
            (
                "https://user:s3cret@mirror.example",
                "must not carry credentials",
            ),
            ("https://mirror.example/?x=1", "query or a fragment"),
            ("", "is not a URL"),
        ] {
            let e = parse_mirror(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
            assert!(!e.contains("s3cret"), "{e}");
        }
    }

    #[test]
    fn the_daemon_configuration_names_exactly_the_mirrors_in_order_and_none_leaves_no_file() {
        let dir = std::env::temp_dir().join(format!("billet-mirrors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let urls = vec![
            "https://b.example".to_owned(),
            "http://a.example:5000".to_owned(),
        ];
        let mirrors = GuestMirrors::prepare(&dir, urls.clone()).unwrap();
        let path = mirrors.daemon_json().unwrap().to_owned();
        let read: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(read, serde_json::json!({ "registry-mirrors": urls }));
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o644
        );
        assert_eq!(
            mirrors.env_value().as_deref(),
            Some("https://b.example,http://a.example:5000")
        );
        let none = GuestMirrors::prepare(&dir, Vec::new()).unwrap();
        assert_eq!(none, GuestMirrors::default());
        assert!(none.env_value().is_none());
        assert!(
            !path.exists(),
            "the file of an earlier configuration stayed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
