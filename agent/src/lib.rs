//! The billet node agent as a library: `billet` is a thin `main` over this.
//! The modules stand on floors: each imports only from the floors below it
//! (`scripts/floors` checks this in the test command). ARCHITECTURE.md's
//! codemap has a paragraph and the invariants for each.
//!
//! - floor 0: [`model`] (the node's own value types), [`clock`] (the
//!   plane's time), [`claim`] (exclusive claims on host files), [`listen`]
//!   (connection caps shared by every listener), [`local`] (the local
//!   socket's path and its client).
//! - floor 1: [`tls`] (mTLS material, the acceptor, enrolment requests),
//!   [`journal`] (the node's memory in SQLite).
//! - floor 2: [`cache`] (sticky disks and the Actions cache).
//! - floor 3: [`provider`] (what runs a runner: Docker, and the fake).
//! - floor 4: [`node`] (the core: runner, custody, health, metrics, the
//!   plane ports), [`upgrade`] (replacing this host's `billet`).
//! - floor 5: [`edge`] (the gRPC face: wire conversions, the session and
//!   its command slot, the plane link, the local socket's service, the
//!   server that wires everything).
//! - floor 6: [`cli`] (the command line and its exit codes).

#![warn(unreachable_pub, missing_docs)]
// These docs are a map for the crate's own developers, read with
// `cargo doc --document-private-items`: public items may point at the
// private ones that implement them.
#![allow(rustdoc::private_intra_doc_links)]

mod access;
pub mod cache;
mod claim;
pub mod cli;
mod clock;
pub mod edge;
pub mod journal;
mod listen;
pub mod local;
pub mod model;
pub mod node;
pub mod provider;
pub mod tls;
pub mod upgrade;
