//! The release this binary is: the version `billet --version` prints, `Hello`
//! carries and the updater compares against a release manifest.
//!
//! The version lives in a fixed-size, marked slot in the binary
//! ([`STAMP_MARKER`] then [`STAMP_SLOT_BYTES`] bytes), read at run time. An
//! unstamped build (the slot all zeros) is its crate version. A release is
//! made by stamping a copy of a built binary with [`stamp`] (the
//! `billet-release` tool does this while writing a release directory), the
//! way Go releases set a version at link time: one compile yields any
//! number of differently versioned releases, which is also how the upgrade
//! tests get a "second build" without compiling the workspace twice.

/// The bytes that precede the version slot. They occur exactly once in a
/// `billet` binary: [`stamp`] refuses a binary where they do not.
pub(crate) const STAMP_MARKER: &[u8; 24] = b"\0billet.version.stamp.v1";

/// The size of the version slot, in bytes: the longest stampable version.
pub(crate) const STAMP_SLOT_BYTES: usize = 64;

const STAMP_BYTES: usize = STAMP_MARKER.len() + STAMP_SLOT_BYTES;

/// The marker followed by an empty (all zero) slot.
static STAMP: [u8; STAMP_BYTES] = {
    let mut bytes = [0u8; STAMP_BYTES];
    let mut i = 0;
    while i < STAMP_MARKER.len() {
        bytes[i] = STAMP_MARKER[i];
        i += 1;
    }
    bytes
};

/// The commit this binary was built from (`git rev-parse --short=12`), or
/// `unknown` (agent/build.rs).
pub(crate) const COMMIT: &str = env!("BILLET_COMMIT");

/// This binary's version: the stamped one, or the crate version when the
/// binary was never stamped.
pub fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        // Through an opaque reference, so the compiler reads the bytes the
        // file holds rather than folding the all-zero initialiser.
        let stamp: &[u8; STAMP_BYTES] = std::hint::black_box(&STAMP);
        read_slot(&stamp[STAMP_MARKER.len()..])
            .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_owned())
    })
}

fn read_slot(slot: &[u8]) -> Option<String> {
    let len = slot.iter().position(|&b| b == 0).unwrap_or(slot.len());
    let text = std::str::from_utf8(&slot[..len]).ok()?;
    (!text.is_empty()).then(|| text.to_owned())
}

/// Why a binary cannot be stamped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StampError {
    /// The version is empty, too long, or has characters a version has not.
    #[error(
        "version {0:?}: must be 1 to {STAMP_SLOT_BYTES} characters of letters, digits, '.', '-' and '+'"
    )]
    Version(String),
    /// The binary does not hold exactly one version slot.
    #[error("the binary holds {0} version slots where a billet binary holds exactly one")]
    Slots(usize),
}

/// Checks that `version` can be stamped: 1 to [`STAMP_SLOT_BYTES`] bytes of
/// ASCII letters, digits, `.`, `-` and `+` (also what makes it safe as a
/// path component of a release source).
///
/// # Errors
///
/// [`StampError::Version`].
pub fn check(version: &str) -> Result<(), StampError> {
    let ok = !version.is_empty()
        && version.len() <= STAMP_SLOT_BYTES
        && !version.starts_with('.')
        && version
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'+'));
    if ok {
        Ok(())
    } else {
        Err(StampError::Version(version.to_owned()))
    }
}

/// Writes `version` into the one version slot of `binary` (the bytes of a
/// `billet` executable), replacing any earlier stamp.
///
/// # Errors
///
/// [`StampError::Version`] for a version [`check`] refuses;
/// [`StampError::Slots`] when the binary holds no slot or several.
pub(crate) fn stamp(binary: &mut [u8], version: &str) -> Result<(), StampError> {
    check(version)?;
    let at: Vec<usize> = binary
        .windows(STAMP_MARKER.len())
        .enumerate()
        .filter(|(_, w)| *w == STAMP_MARKER)
        .map(|(i, _)| i)
        .collect();
    let [at] = at[..] else {
        return Err(StampError::Slots(at.len()));
    };
    let slot = &mut binary[at + STAMP_MARKER.len()..][..STAMP_SLOT_BYTES];
    slot.fill(0);
    slot[..version.len()].copy_from_slice(version.as_bytes());
    Ok(())
}

/// The version stamped in `binary`, the crate version when its slot is
/// empty, or `None` when it holds no single slot.
#[cfg(test)]
pub(crate) fn stamped(binary: &[u8]) -> Option<String> {
    let mut at = binary
        .windows(STAMP_MARKER.len())
        .enumerate()
        .filter(|(_, w)| *w == STAMP_MARKER)
        .map(|(i, _)| i);
    let first = at.next()?;
    if at.next().is_some() {
        return None;
    }
    let slot = binary
        .get(first + STAMP_MARKER.len()..)?
        .get(..STAMP_SLOT_BYTES)?;
    Some(read_slot(slot).unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_binary() -> Vec<u8> {
        let mut b = b"ELF....".to_vec();
        b.extend_from_slice(&STAMP);
        b.extend_from_slice(b"....rest");
        b
    }

    #[test]
    fn an_unstamped_binary_is_its_crate_version() {
        assert_eq!(version(), env!("CARGO_PKG_VERSION"));
        assert_eq!(
            stamped(&fake_binary()).as_deref(),
            Some(env!("CARGO_PKG_VERSION"))
        );
    }

    #[test]
    fn stamping_replaces_the_slot_and_nothing_else() {
        let mut b = fake_binary();
        let before = b.clone();
        stamp(&mut b, "1.2.3-rc.1+build.7").expect("stamp");
        assert_eq!(stamped(&b).as_deref(), Some("1.2.3-rc.1+build.7"));
        assert_eq!(b.len(), before.len());
        stamp(&mut b, "2").expect("restamp");
        assert_eq!(stamped(&b).as_deref(), Some("2"));
        let changed = b.iter().zip(&before).filter(|(x, y)| x != y).count();
        assert_eq!(changed, 1, "only the slot's first byte differs from blank");
    }

    #[test]
    fn a_binary_without_exactly_one_slot_is_refused() {
        let mut none = b"no slot here".to_vec();
        assert_eq!(stamp(&mut none, "1.0.0"), Err(StampError::Slots(0)));
        let mut two = fake_binary();
        two.extend_from_slice(&STAMP);
        assert_eq!(stamp(&mut two, "1.0.0"), Err(StampError::Slots(2)));
        assert_eq!(stamped(&two), None);
    }

    #[test]
    fn versions_that_are_not_plain_release_names_are_refused() {
        for bad in ["", "../etc", "1.0 beta", "v1/2", ".hidden", &"9".repeat(65)] {
            assert!(check(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["0.1.0", "1.2.3-rc.1", "2026.11.30+abc", &"9".repeat(64)] {
            check(good).expect(good);
        }
    }
}
