//! The node's core: turns each assigned lease into running compute and
//! cleans up exactly what it started.
//!
//! Owns: lease state on this host ([`runner`] for the ordinary lifecycle,
//! [`custody`] for compute held on the node's own authority, [`ending`] for
//! why compute ended and how its registration is removed), start-up
//! recovery's gate ([`recovery`]), the ports it asks the plane through
//! ([`plane`]), its health and degraded reasons ([`health`]), its metrics
//! ([`metrics`]), spot interruption notices ([`interruption`]), the warm
//! runners started ahead of their jobs ([`warm`]), the runner versions
//! it refuses to launch ([`freshness`]), and the tiers it refuses after
//! consecutive start failures ([`tiers`]).
//!
//! May not touch: generated proto types (that is the gRPC face's, `edge`), the
//! Docker engine except through [`crate::provider::Provider`], SQLite except
//! through [`crate::journal`], and the installed binary (that is the
//! updater's, `upgrade`).

pub(crate) mod custody;
mod destroy;
pub mod ending;
pub mod freshness;
pub mod health;
mod interrupt;
pub mod interruption;
pub mod metrics;
pub mod plane;
mod recover;
pub(crate) mod recovery;
pub mod runner;
mod sweep;
pub mod tiers;
pub mod warm;
