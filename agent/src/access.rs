//! Who may use a path, said so that an operator can act on it: when the
//! kernel refuses (`EACCES`, `EPERM`), the bare error names neither the
//! path's owner and mode nor the user asking, and those are what the
//! operator must change.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A user or group id with its name when the system knows it:
/// `billet (uid 999)`.
fn user(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => format!("{} (uid {uid})", u.name),
        _ => format!("uid {uid}"),
    }
}

fn group(gid: u32) -> String {
    match nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid)) {
        Ok(Some(g)) => format!("{} (gid {gid})", g.name),
        _ => format!("gid {gid}"),
    }
}

/// This process's effective user, as [`user`] names it.
pub(crate) fn current_user() -> String {
    user(nix::unistd::Uid::effective().as_raw())
}

/// Whether `e` is the kernel refusing this user, rather than the path
/// being absent or broken.
pub(crate) fn is_refusal(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::PermissionDenied
        || e.raw_os_error() == Some(nix::errno::Errno::EPERM as i32)
}

/// `path`, or the nearest ancestor this user can see, with its owner,
/// group and mode: `/var/lib/billet is owned by billet (uid 999), group
/// billet (gid 999), mode 0700`. The ancestor is the one that refuses when
/// `path` itself cannot be looked at.
pub(crate) fn ownership(path: &Path) -> String {
    let Some((seen, meta)) = path
        .ancestors()
        .find_map(|p| std::fs::metadata(p).ok().map(|m| (p, m)))
    else {
        return format!("{} cannot be looked at", path.display());
    };
    format!(
        "{} is owned by {}, group {}, mode {:04o}",
        seen.display(),
        user(meta.uid()),
        group(meta.gid()),
        meta.mode() & 0o7777
    )
}

/// The sentence for a refusal `e` met while doing `what` on `path`:
/// what failed, who owns what, who asked, and `change` (what the
/// operator can do).
pub(crate) fn refused(path: &Path, what: &str, e: &io::Error, change: &str) -> String {
    format!(
        "cannot {what} {}: {e}; {}, and this process runs as {}: {change}",
        path.display(),
        ownership(path),
        current_user()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownership_names_the_owner_group_and_mode_of_the_nearest_visible_path() {
        let dir = std::env::temp_dir().join(format!("billet-access-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o750))
            .unwrap();
        let said = ownership(&dir.join("absent").join("deeper"));
        assert!(
            said.starts_with(&format!("{} is owned by ", dir.display())),
            "{said}"
        );
        assert!(said.contains("uid "), "{said}");
        assert!(said.contains(", mode 0750"), "{said}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn eperm_and_eacces_are_refusals_and_enoent_is_not() {
        assert!(is_refusal(&io::Error::from_raw_os_error(1)));
        assert!(is_refusal(&io::Error::from_raw_os_error(13)));
        assert!(!is_refusal(&io::Error::from_raw_os_error(2)));
    }
}
