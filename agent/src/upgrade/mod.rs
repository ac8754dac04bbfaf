//! Replacing this host's `billet` with an exact release, without losing a
//! running job.
//!
//! Owns: how `StartUpgrade` hands the work to the updater and the one-line
//! answer both ends speak ([`dispatch`]), the updater itself, with its host
//! claim, fence, journal, swap and rollback ([`updater`]), where releases
//! come from and how they are checked ([`release`]), and the version stamped
//! into a binary ([`version`]).
//!
//! May not touch: lease state or the provider. The node's core reaches this
//! folder only through [`dispatch::Upgrader`]; the updater reaches the node
//! only through its service manager and its local socket
//! ([`crate::local`]).

pub mod dispatch;
pub mod release;
pub mod updater;
pub mod version;
