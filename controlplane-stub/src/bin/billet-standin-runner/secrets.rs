//! Credentials handed over once (`BILLET_SECRETS_FILE`): the node writes `KEY=VALUE` lines
//! (the JIT config, the cache token, the Actions cache proxy URL) into a FIFO once the runner
//! opens it, so none of them is in what the engine records about the container. The runner
//! reads them first thing and runs itself again with them in its own environment, as the
//! entrypoint of any runner image does before it execs `actions/runner`.

use std::os::unix::process::CommandExt as _;

/// The variable naming the file to read the credentials from.
pub(crate) const SECRETS_ENV: &str = "BILLET_SECRETS_FILE";

/// With [`SECRETS_ENV`] set: reads the credentials (waiting until the node writes them) and
/// replaces this process with itself, the credentials in its environment and [`SECRETS_ENV`]
/// gone. Returns only when that failed, with why; without [`SECRETS_ENV`], returns `None`.
pub(crate) fn exec_with_secrets() -> Option<String> {
    let path = std::env::var_os(SECRETS_ENV)?;
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            return Some(format!(
                "cannot read the credentials at {}: {e}",
                std::path::Path::new(&path).display()
            ));
        }
    };
    let mut pairs = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        match line.split_once('=') {
            Some((key, value)) if !key.is_empty() => pairs.push((key, value)),
            // Never the line itself: it may hold a credential.
            _ => return Some("a line of the credentials is not KEY=VALUE".to_owned()),
        }
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return Some(format!("cannot find this executable: {e}")),
    };
    let error = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env_remove(SECRETS_ENV)
        .envs(pairs)
        .exec();
    Some(format!("cannot run again with the credentials: {error}"))
}
