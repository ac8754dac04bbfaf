//! What the guest may do to its host, said once at start: whether a raw
//! socket opens (it needs `CAP_NET_RAW`, which a node's guests lack), the
//! kernel's `no_new_privs` flag, and the pids limit of the guest's cgroup.

/// One line: `raw socket <opened|refused: ...>; no_new_privs <0|1|unknown>;
/// pids.max <value|unknown>`.
pub(crate) fn confinement() -> String {
    let raw = match socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::RAW,
        Some(socket2::Protocol::ICMPV4),
    ) {
        Ok(_) => "opened".to_owned(),
        Err(e) => format!("refused: {e}"),
    };
    let no_new_privs = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("NoNewPrivs:").map(|v| v.trim().to_owned()))
        })
        .unwrap_or_else(|| "unknown".to_owned());
    // cgroup v2 at the root of the guest's view, v1 under its controller.
    let pids_max = ["/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/pids/pids.max"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .map_or_else(|| "unknown".to_owned(), |v| v.trim().to_owned());
    format!("raw socket {raw}; no_new_privs {no_new_privs}; pids.max {pids_max}")
}
