//! Runner versions, as an image's label and the plane's minimum spell them:
//! both sides of the wire read `TierSpec.min_runner_version` with this.

use std::fmt;

/// An `actions/runner` version: `2.331.0`, with or without a leading `v`;
/// `2.331` reads as `2.331.0`. Ordered as releases are.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunnerVersion(semver::Version);

impl RunnerVersion {
    /// Reads `text`, or says what a runner version looks like.
    ///
    /// # Errors
    ///
    /// A text that is not `MAJOR.MINOR[.PATCH]` (an optional `v` first, an
    /// optional pre-release or build suffix after).
    pub fn parse(text: &str) -> Result<Self, String> {
        let bare = text.trim();
        let bare = bare.strip_prefix(['v', 'V']).unwrap_or(bare);
        let full = if bare.matches('.').count() == 1 && !bare.contains(['-', '+']) {
            format!("{bare}.0")
        } else {
            bare.to_owned()
        };
        semver::Version::parse(&full)
            .map(Self)
            .map_err(|e| format!("{text:?} is not a runner version such as 2.331.0 ({e})"))
    }
}

impl fmt::Display for RunnerVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::RunnerVersion;

    #[test]
    fn versions_read_with_or_without_v_and_patch_and_order_as_releases() {
        let v = |t| RunnerVersion::parse(t).unwrap();
        assert_eq!(v("v2.331.0"), v("2.331.0"));
        assert_eq!(v("2.331"), v("2.331.0"));
        assert!(v("2.330.9") < v("2.331.0"));
        assert!(v("2.331.0") < v("2.331.1"));
        assert!(v("2.99.0") < v("2.100.0"));
        assert_eq!(v("2.331.0").to_string(), "2.331.0");
    }

    #[test]
    fn a_text_that_is_no_version_is_refused_naming_it() {
        for bad in ["", "latest", "2", "two.three.four"] {
            let e = RunnerVersion::parse(bad).unwrap_err();
            assert!(e.contains("is not a runner version"), "{bad}: {e}");
        }
    }
}
