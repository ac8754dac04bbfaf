//! [`Phase`], where a lease is in its life, and its table of legal moves:
//! the one copy in `billet-proto` ([`billet_proto::phase`]), shared with the
//! node so the two cannot drift. [`Ledger::advance`](super::Ledger::advance)
//! refuses any edge the table does not list, and the reaper's fixed moves
//! (to quarantine, to failed) are edges of it. The `CHECK` on
//! `leases.phase` in `schema.rs` spells the same ten names, so a new phase
//! is a migration too.

pub use billet_proto::phase::Phase;
