//! Generated code for the billet node wire (`billet.node.v1`).
//!
//! The agent and the stub plane convert these messages into their own types
//! at the edge. The logic here is what both ends judge by and so must
//! share: [`phase`], the lease phases `Lease.phase` spells and the edges
//! between them, and [`ending`], the closed set of reasons a lease ends for
//! and the class of each, which the node records and the plane reads. The
//! protocol version both ends must agree on is [`PROTOCOL_VERSION`].

#![allow(missing_docs, clippy::all, missing_debug_implementations)]

/// The wire version this build speaks. Bump it for any change an older peer
/// would misread; `Open` and `Hello` carry it and a mismatch is refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// `billet.node.v1`.
pub mod v1 {
    tonic::include_proto!("billet.node.v1");

    /// The encoded `FileDescriptorSet` of `billet/node/v1/node.proto`, for
    /// gRPC server reflection (so `grpcurl` can list and describe).
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/billet_node_v1_descriptor.bin"));

    /// A JIT config is a credential until the runner consumes it, and it
    /// travels in `Launch` and in `MintJit`'s reply: a `Debug` of either
    /// (a logged command, a failed assertion) shows the registration's id
    /// and name and never the config.
    impl std::fmt::Debug for JitConfig {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("JitConfig")
                .field("encoded_jit_config", &"<redacted>")
                .field("runner_id", &self.runner_id)
                .field("runner_name", &self.runner_name)
                .finish()
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_launch_debug_never_shows_its_jit_config() {
            let launch = super::Launch {
                registration: Some(super::JitConfig {
                    encoded_jit_config: "c2VjcmV0LWppdA==".into(),
                    runner_id: 7,
                    runner_name: "billet-l1".into(),
                }),
                ..Default::default()
            };
            let shown = format!("{launch:?}");
            assert!(!shown.contains("c2VjcmV0LWppdA=="), "{shown}");
            assert!(
                shown.contains("<redacted>") && shown.contains("billet-l1"),
                "{shown}"
            );
        }
    }
}

/// Lease phases and their legal moves.
pub mod phase;

/// Runner versions, and their order.
pub mod runner_version;

/// Why a lease ended, and whose outcome that was.
pub mod ending;
