//! Shared harness for the end-to-end tests and the demo: build the stand-in
//! runner image, make certificates, start the emulator, the plane and real
//! node processes.

pub mod bench;
pub mod cluster;
pub mod engine_proxy;
pub mod fleet;
pub mod image;
pub mod imds;
pub mod loopback;
pub mod planes;
pub mod reports;
pub mod results;
pub mod scratchfs;
pub mod systemd;
