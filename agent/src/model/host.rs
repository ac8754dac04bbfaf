//! What a tier's guests may be given of the host, and the rule that an
//! untrusted tier is given none of it (decision 125).
//!
//! Every guest starts from the node's hardened default (the provider's:
//! fewer capabilities, `no-new-privileges`, a pids limit, the engine's
//! seccomp profile and masked paths). A trusted tier may ask for more
//! ([`HostAccess`]); an untrusted one asking for any of it, or for the
//! host's network, is refused at the edge before anything is minted.

use super::{InvalidField, Trust};

/// What a trusted tier's guests are given of the host beyond the node's
/// hardened default. The default is nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostAccess {
    /// The host's PID namespace.
    pub pid: bool,
    /// The host's IPC namespace.
    pub ipc: bool,
    /// The host's UTS namespace.
    pub uts: bool,
    /// Every capability and device.
    pub privileged: bool,
    /// Host device paths, each bound at the same path.
    pub devices: Vec<String>,
    /// Capabilities beyond the node's default set, upper case, without the
    /// `CAP_` prefix.
    pub capabilities: Vec<String>,
    /// Host paths bound into the guest.
    pub mounts: Vec<HostMount>,
    /// Setuid programs may raise privilege (no `no-new-privileges`).
    pub new_privileges: bool,
}

/// A host path a trusted tier's guests see.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostMount {
    /// An absolute path on the host.
    pub source: String,
    /// An absolute path in the guest.
    pub target: String,
    /// Bound read-only.
    pub read_only: bool,
}

/// The network mode that is the host's own.
pub(crate) const HOST_NETWORK: &str = "host";

impl HostAccess {
    /// Whether nothing beyond the default is asked.
    pub fn is_none(&self) -> bool {
        *self == Self::default()
    }

    /// Refuses what a tier of `trust` may not ask for: for an untrusted
    /// tier, the host's network, any host namespace, privilege, a device,
    /// an added capability or a host mount. `field` is the tier's field
    /// path (`launch.tier`); the error names the first field at fault.
    ///
    /// # Errors
    ///
    /// [`InvalidField`] naming `<field>.network` or `<field>.host.<part>`.
    pub(crate) fn check_trust(
        &self,
        trust: Trust,
        network: Option<&str>,
        field: &str,
    ) -> Result<(), InvalidField> {
        if trust == Trust::Trusted {
            return Ok(());
        }
        let refuse = |part: &str, what: &str| {
            Err(InvalidField::new(
                format!("{field}.{part}"),
                format!(
                    "an untrusted tier may not have {what}; only a trusted tier may ask for the host"
                ),
            ))
        };
        if network == Some(HOST_NETWORK) {
            return refuse("network", "the host's network");
        }
        let Self {
            pid,
            ipc,
            uts,
            privileged,
            devices,
            capabilities,
            mounts,
            new_privileges,
        } = self;
        if *pid {
            return refuse("host.pid", "the host's PID namespace");
        }
        if *ipc {
            return refuse("host.ipc", "the host's IPC namespace");
        }
        if *uts {
            return refuse("host.uts", "the host's UTS namespace");
        }
        if *privileged {
            return refuse("host.privileged", "privilege");
        }
        if !devices.is_empty() {
            return refuse("host.devices", "a host device");
        }
        if !capabilities.is_empty() {
            return refuse("host.capabilities", "added capabilities");
        }
        if !mounts.is_empty() {
            return refuse("host.mounts", "a host path the node did not make");
        }
        if *new_privileges {
            return refuse(
                "host.new_privileges",
                "setuid programs that raise privilege",
            );
        }
        Ok(())
    }
}

/// Checks a capability's name: upper-case letters, digits and `_`, without
/// the `CAP_` prefix, returned as the engine spells it.
///
/// # Errors
///
/// [`InvalidField`] naming `field`.
pub(crate) fn capability(field: &str, name: &str) -> Result<String, InvalidField> {
    let bare = name.strip_prefix("CAP_").unwrap_or(name);
    if bare.is_empty()
        || bare.len() > 32
        || !bare
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(InvalidField::new(
            field,
            format!("{name:?} is not a capability name such as SYS_ADMIN"),
        ));
    }
    Ok(bare.to_owned())
}

/// Checks an absolute path of at most 4096 bytes without `.`, `..` or NUL,
/// and not `/`.
///
/// # Errors
///
/// [`InvalidField`] naming `field`.
pub(crate) fn absolute_path(field: &str, path: &str) -> Result<(), InvalidField> {
    let fine = path.starts_with('/')
        && path.len() > 1
        && path.len() <= 4096
        && !path.contains('\0')
        && path.split('/').all(|p| p != "." && p != "..");
    if fine {
        Ok(())
    } else {
        Err(InvalidField::new(
            field,
            format!("{path:?} is not an absolute path other than / without . or .. parts"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(access: &HostAccess, network: Option<&str>) -> Option<String> {
        access
            .check_trust(Trust::Untrusted, network, "launch.tier")
            .err()
            .map(|e| e.field)
    }

    #[test]
    fn an_untrusted_tier_is_refused_each_part_of_the_host_naming_it() {
        let mount = HostMount {
            source: "/var/run/docker.sock".into(),
            target: "/var/run/docker.sock".into(),
            read_only: false,
        };
        let cases: Vec<(HostAccess, Option<&str>, &str)> = vec![
            (HostAccess::default(), Some("host"), "launch.tier.network"),
            (
                HostAccess {
                    pid: true,
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.pid",
            ),
            (
                HostAccess {
                    ipc: true,
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.ipc",
            ),
            (
                HostAccess {
                    uts: true,
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.uts",
            ),
            (
                HostAccess {
                    privileged: true,
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.privileged",
            ),
            (
                HostAccess {
                    devices: vec!["/dev/fuse".into()],
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.devices",
            ),
            (
                HostAccess {
                    capabilities: vec!["SYS_ADMIN".into()],
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.capabilities",
            ),
            (
                HostAccess {
                    new_privileges: true,
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.new_privileges",
            ),
            (
                HostAccess {
                    mounts: vec![mount],
                    ..HostAccess::default()
                },
                None,
                "launch.tier.host.mounts",
            ),
        ];
        for (access, network, field) in cases {
            assert_eq!(refusal(&access, network).as_deref(), Some(field));
            assert!(
                access
                    .check_trust(Trust::Trusted, network, "launch.tier")
                    .is_ok(),
                "a trusted tier may ask for {field}"
            );
        }
    }

    #[test]
    fn an_untrusted_tier_on_its_own_or_a_named_network_asks_nothing_of_the_host() {
        for network in [None, Some("bridge"), Some("none"), Some("billet-untrusted")] {
            assert_eq!(refusal(&HostAccess::default(), network), None);
        }
    }

    #[test]
    fn capabilities_and_paths_are_checked() {
        assert_eq!(capability("f", "CAP_SYS_ADMIN").unwrap(), "SYS_ADMIN");
        assert_eq!(capability("f", "NET_ADMIN").unwrap(), "NET_ADMIN");
        assert!(capability("f", "sys_admin").is_err());
        assert!(capability("f", "").is_err());
        assert!(absolute_path("f", "/dev/fuse").is_ok());
        for bad in ["/", "dev/fuse", "/a/../b", "/a/./b", ""] {
            assert!(absolute_path("f", bad).is_err(), "{bad}");
        }
    }
}
