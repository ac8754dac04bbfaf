//! The billet node agent as a library: `billet` is a thin `main` over this.
//! The folders are the subsystems; ARCHITECTURE.md's codemap has a
//! paragraph and the invariants for each.
//!
//! - [`node`]: the node's core: the runner and custody, the plane session
//!   and its single command slot, the plane link, the journal, the local
//!   socket, and the server that wires them together.
//! - [`provider`]: what actually runs a runner (Docker, and the fake).
//! - [`upgrade`]: replacing this host's `billet`: the dispatch of
//!   `StartUpgrade`, the updater, releases and version stamping.
//! - [`edge`]: where the outside world's shapes become the node's own: the
//!   node's types, the proto conversions, and mTLS.
//! - [`cache`]: the node-local cache: sticky disks, their generations,
//!   mounts, commits and eviction.
//! - [`claim`]: exclusive claims on host files (the updater's host claim,
//!   the cache store's lock), patient with a forked child's inherited lock.
//! - [`cli`]: the command line, the configuration layering and the exit
//!   codes of the `billet` binary.

pub mod cache;
pub mod claim;
pub mod cli;
pub mod edge;
pub mod node;
pub mod provider;
pub mod upgrade;
