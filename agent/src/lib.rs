//! The billet node agent as a library: `billet node` is a thin `main` over
//! this. See ARCHITECTURE.md for the codemap and invariants.

pub mod config_file;
pub mod hostupgrade;
pub mod journal;
pub mod local;
pub mod model;
pub mod plane;
pub mod provider;
pub mod release;
pub mod runner;
pub mod server;
pub mod session;
pub mod slot;
pub mod tls;
pub mod upgrade;
pub mod version;
pub mod wire;
