//! What registry mirrors the runner's node handed it, said once at start.

/// Where a guest that runs Docker finds its daemon configuration.
pub(crate) const DAEMON_JSON: &str = "/etc/docker/daemon.json";

/// What the runner sees of the registry mirrors its node hands it, in one line:
/// `env <value of BILLET_REGISTRY_MIRRORS, or unset>; daemon.json <its registry-mirrors as
/// JSON, or absent>`. A daemon configuration that is not JSON is said so.
pub(crate) fn registry_mirrors(env: Option<&str>, daemon_json: &std::path::Path) -> String {
    let env = env.map_or_else(|| "unset".to_owned(), |v| format!("{v:?}"));
    let file = match std::fs::read_to_string(daemon_json) {
        Ok(text) => match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v) => v
                .get("registry-mirrors")
                .map_or_else(|| "no registry-mirrors".to_owned(), ToString::to_string),
            Err(e) => format!("not JSON: {e}"),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "absent".to_owned(),
        Err(e) => format!("unreadable: {e}"),
    };
    format!("env {env}; daemon.json {file}")
}
