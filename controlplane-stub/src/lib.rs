//! The stand-in billet control plane as a library: enough of a plane to drive
//! real nodes end to end in tests and in the demo. See ARCHITECTURE.md.
//!
//! It never depends on the agent crate: it speaks the wire like any plane.

#![warn(unreachable_pub)]
// These docs are a map for the crate's own developers, read with
// `cargo doc --document-private-items`: public items may point at the
// private ones that implement them.
#![allow(rustdoc::private_intra_doc_links)]

pub mod calls;
pub(crate) mod enroll;
pub mod github;
pub mod identity;
pub mod jobs;
pub mod ledger;
pub mod node_link;
pub mod plane;

/// Now, in unix milliseconds.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
