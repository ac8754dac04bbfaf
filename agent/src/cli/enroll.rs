//! `billet node enroll`: hands a join token to the node running on this
//! host, through its local socket, so a node whose certificate expired gets
//! a new one from the plane's enrolment endpoint without a restart and
//! without touching what it runs ([`crate::edge::identity`]).
//!
//! The token is a credential: give it with `--token-file` or
//! `BILLET_JOIN_TOKEN` rather than `--token` where other users can read the
//! process list; it is never printed.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use super::exit;
use crate::local::EnrollFailure;
use crate::tls::enroll::JoinToken;

/// `billet node enroll`'s flags.
#[derive(Debug, clap::Parser)]
#[command(
    name = "enroll",
    bin_name = "billet node enroll",
    about = "Re-enrol the node on this host with a one-time join token from the plane: it makes a fresh key, gets a certificate from the plane's enrolment endpoint and serves it at once, without a restart"
)]
pub struct EnrollArgs {
    /// The node's configuration file; its `state_dir` is used (relative to
    /// the file's directory) unless --state-dir is given.
    #[arg(long, env = "BILLET_CONFIG")]
    pub config: Option<PathBuf>,
    /// The node's state directory, where its local socket is.
    #[arg(long, env = "BILLET_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The join token the plane printed (`billet-plane --join-token NODE`).
    #[arg(
        long,
        env = "BILLET_JOIN_TOKEN",
        hide_env_values = true,
        conflicts_with = "token_file",
        required_unless_present = "token_file"
    )]
    pub token: Option<String>,
    /// A file holding the join token.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// The plane's enrolment endpoint, HOST:PORT (`billet-plane
    /// --enroll-listen`). Its certificate must chain to the node's CA and
    /// carry the plane's name.
    #[arg(long)]
    pub plane: String,
    /// Seconds to wait for the node's answer.
    #[arg(long, default_value_t = 60, value_parser = super::within::<0, { super::MAX_FLAG_SECS }>)]
    pub timeout_secs: u64,
}

/// Runs `billet node enroll`: 0 when the new certificate is in force,
/// [`exit::CONFIG`] for a flag or file it cannot read, [`exit::TLS`] when
/// the plane refused the token (unknown, used, expired, another node's),
/// [`exit::NOT_RUNNING`] when no node answers, [`exit::SERVE`] otherwise.
pub fn enroll(args: EnrollArgs) -> ExitCode {
    let state_dir =
        match super::status::resolve_state_dir(args.state_dir.as_ref(), args.config.as_ref()) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(exit::CONFIG);
            }
        };
    let text = match (&args.token, &args.token_file) {
        (Some(t), _) => t.clone(),
        (None, Some(file)) => match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: --token-file {}: cannot read: {e}", file.display());
                return ExitCode::from(exit::CONFIG);
            }
        },
        (None, None) => {
            eprintln!("error: give the join token with --token, --token-file or BILLET_JOIN_TOKEN");
            return ExitCode::from(exit::CONFIG);
        }
    };
    let token = match JoinToken::parse(&text) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(exit::CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::SERVE);
        }
    };
    let enrolled = runtime.block_on(crate::local::enroll(
        &state_dir,
        &token,
        &args.plane,
        Duration::from_secs(args.timeout_secs.max(1)),
    ));
    match enrolled {
        Ok(not_after_unix_ms) => {
            println!(
                "enrolled: a new certificate is in force, valid until {not_after_unix_ms} (unix ms); the plane can attach again"
            );
            ExitCode::SUCCESS
        }
        Err(EnrollFailure::NotRunning(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(exit::NOT_RUNNING)
        }
        Err(EnrollFailure::Refused(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(exit::TLS)
        }
        Err(EnrollFailure::Failed(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(exit::SERVE)
        }
    }
}
