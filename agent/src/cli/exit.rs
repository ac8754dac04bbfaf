//! The `billet` binary's exit codes: one table (README "Exit codes"), and
//! the one function from the node's start-up errors to it.

use crate::edge::server::NodeError;

/// A configuration value is invalid.
pub const CONFIG: u8 = 2;
pub(crate) const TLS: u8 = 3;
/// The listen address cannot be bound.
pub const BIND: u8 = 4;
pub(crate) const PROVIDER: u8 = 5;
pub(crate) const STATE: u8 = 6;
pub(crate) const JOURNAL: u8 = 7;
pub(crate) const UPGRADE_REFUSED: u8 = 8;
pub(crate) const UPGRADE_FAILED: u8 = 9;
/// `billet node status`: no node answers on the state directory's socket.
pub(crate) const NOT_RUNNING: u8 = 10;
/// The gRPC server failed while serving.
pub const SERVE: u8 = 1;
/// A thread or task of the node panicked: a bug, stopped at once rather
/// than left half alive ([`super::stop_on_panic`]). Rust's own code for a
/// panic on the main thread, so every panic ends the same way.
pub const PANIC: u8 = 101;

/// The exit code for an error of [`crate::edge::server::prepare`] or
/// [`crate::edge::server::run`].
pub fn for_node_error(e: &NodeError) -> u8 {
    match e {
        NodeError::Tls(_) => TLS,
        NodeError::StateDir { .. } | NodeError::Local(_) | NodeError::Cache(_) => STATE,
        NodeError::Provider(_) => PROVIDER,
        NodeError::Journal(_) => JOURNAL,
        NodeError::Serve(_) | NodeError::Reflection(_) => SERVE,
        // The flag's parser refuses a bad endpoint before start-up; this is
        // the same refusal reached another way.
        NodeError::Interruptions(_) => CONFIG,
        NodeError::ActionsProxy(_) => BIND,
    }
}
