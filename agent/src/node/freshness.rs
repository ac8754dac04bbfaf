//! Fresh by construction: the node launches no runner GitHub will refuse
//! for its version.
//!
//! Two ways to know (decision 114). An image's label
//! ([`RUNNER_VERSION_LABEL`]) says which runner it carries, and a launch
//! whose image's runner is older than the tier's minimum is refused before
//! anything is minted. An image without the label is learnt the hard way,
//! once: a runner that exits before coming online saying GitHub refused its
//! version ([`says_version_refused`]) marks its image, by id, and every
//! later launch of that image is refused before a mint, until the image
//! changes (a rebuild gives it another id). What the node has refused is
//! in `billet node status` and its metrics.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::model::RunnerVersion;
use crate::provider::{ImageFacts, RUNNER_VERSION_LABEL};

/// How many refused images the node remembers; the oldest goes first.
const REMEMBERED: usize = 64;

/// What the runner prints, in lower case, when GitHub refuses it for its
/// version: the deprecation notice (`Runner version v2.331.0 is deprecated
/// and cannot receive messages.`), the registration refusals below the
/// minimum, and the self-update a disabled update cannot do.
const REFUSALS: [&str; 6] = [
    "is deprecated and cannot receive messages",
    "runner version is deprecated",
    "version is no longer supported",
    "minimum required runner version",
    "runner version is too old",
    "the runner version is outdated",
];

/// Whether a runner's last output says GitHub refused it for its version.
pub(crate) fn says_version_refused(output: &str) -> bool {
    let output = output.to_lowercase();
    REFUSALS.iter().any(|r| output.contains(r))
}

/// Why an image may not run, as `billet node status` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutdatedImage {
    /// The image reference a tier names.
    pub image: String,
    /// The image's id when it was refused.
    pub id: String,
    /// The runner version its label says, if any.
    pub version: Option<String>,
    /// The minimum it was held against, when its label was too old;
    /// `None` when a runner of it exited saying GitHub refused it.
    pub minimum: Option<String>,
}

impl OutdatedImage {
    /// The refusal, naming the image, the version and what to do.
    pub(crate) fn explain(&self) -> String {
        let version = self.version.as_deref().unwrap_or("unlabelled");
        match &self.minimum {
            Some(minimum) => format!(
                "image {} carries runner {version} (its {RUNNER_VERSION_LABEL} label), older than the minimum {minimum}; nothing was minted or started: rebuild the image on a newer actions/runner",
                self.image
            ),
            None => format!(
                "a runner of image {} ({version}, id {}) exited saying GitHub refused its version; nothing was minted or started: rebuild the image on a newer actions/runner (a changed image is tried again)",
                self.image, self.id
            ),
        }
    }
}

/// The images this node refuses for their runner's version.
#[derive(Debug, Default)]
pub struct Freshness {
    /// By image id, oldest first in `order`.
    refused: Mutex<(BTreeMap<String, OutdatedImage>, Vec<String>)>,
}

impl Freshness {
    fn refused(&self) -> std::sync::MutexGuard<'_, (BTreeMap<String, OutdatedImage>, Vec<String>)> {
        self.refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether `image`, found as `facts`, may run under `minimum`: `Err`
    /// says why not (and is remembered for status).
    pub(crate) fn judge(
        &self,
        image: &str,
        facts: &ImageFacts,
        minimum: Option<&RunnerVersion>,
    ) -> Result<(), OutdatedImage> {
        if let Some(known) = self
            .refused()
            .0
            .get(&facts.id)
            .filter(|o| o.minimum.is_none())
        {
            return Err(known.clone());
        }
        let (Some(minimum), Some(label)) = (minimum, facts.runner_version.as_deref()) else {
            return Ok(());
        };
        // A label that is no version says nothing the node can hold
        // against a minimum; the runner's own exit still tells.
        let Ok(found) = RunnerVersion::parse(label) else {
            return Ok(());
        };
        if found >= *minimum {
            return Ok(());
        }
        let outdated = OutdatedImage {
            image: image.to_owned(),
            id: facts.id.clone(),
            version: Some(label.to_owned()),
            minimum: Some(minimum.to_string()),
        };
        self.remember(outdated.clone());
        Err(outdated)
    }

    /// A runner of `image` (id `id`) exited saying GitHub refused its
    /// version: that image runs no more here.
    pub(crate) fn rejected(&self, image: &str, id: &str, version: Option<String>) {
        self.remember(OutdatedImage {
            image: image.to_owned(),
            id: id.to_owned(),
            version,
            minimum: None,
        });
    }

    fn remember(&self, outdated: OutdatedImage) {
        let mut guard = self.refused();
        let (by_id, order) = &mut *guard;
        if by_id
            .insert(outdated.id.clone(), outdated.clone())
            .is_none()
        {
            order.push(outdated.id);
        }
        while order.len() > REMEMBERED {
            let oldest = order.remove(0);
            by_id.remove(&oldest);
        }
    }

    /// Every image refused so far, in the order they were first refused.
    pub fn outdated(&self) -> Vec<OutdatedImage> {
        let guard = self.refused();
        guard
            .1
            .iter()
            .filter_map(|id| guard.0.get(id).cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Freshness, says_version_refused};
    use crate::model::RunnerVersion;
    use crate::provider::ImageFacts;

    fn facts(id: &str, version: Option<&str>) -> ImageFacts {
        ImageFacts {
            id: id.into(),
            runner_version: version.map(str::to_owned),
        }
    }

    #[test]
    fn the_runners_refusals_for_its_version_are_read_and_nothing_else_is() {
        assert!(says_version_refused(
            "√ Connected to GitHub\nRunner version v2.331.0 is deprecated and cannot receive messages.\n"
        ));
        assert!(says_version_refused(
            "Error: The runner version is outdated and must be updated"
        ));
        assert!(!says_version_refused("Exiting with code 1: job failed"));
        assert!(!says_version_refused(""));
    }

    #[test]
    fn an_image_labelled_older_than_the_minimum_is_refused_naming_both() {
        let f = Freshness::default();
        let min = RunnerVersion::parse("2.331.0").unwrap();
        let refused = f
            .judge(
                "runner:old",
                &facts("sha256:a", Some("2.320.0")),
                Some(&min),
            )
            .unwrap_err();
        let text = refused.explain();
        assert!(
            text.contains("2.320.0") && text.contains("2.331.0"),
            "{text}"
        );
        assert!(
            f.judge(
                "runner:new",
                &facts("sha256:b", Some("v2.331.0")),
                Some(&min)
            )
            .is_ok()
        );
        // No label, no minimum, or a label that is no version: not judged.
        assert!(
            f.judge("runner:x", &facts("sha256:c", None), Some(&min))
                .is_ok()
        );
        assert!(
            f.judge("runner:old", &facts("sha256:a", Some("2.320.0")), None)
                .is_ok()
        );
        assert!(
            f.judge("runner:y", &facts("sha256:d", Some("latest")), Some(&min))
                .is_ok()
        );
        assert_eq!(f.outdated().len(), 1);
    }

    #[test]
    fn an_image_a_runner_was_rejected_on_is_refused_until_it_changes() {
        let f = Freshness::default();
        f.rejected("runner:dev", "sha256:a", None);
        let refused = f
            .judge("runner:dev", &facts("sha256:a", None), None)
            .unwrap_err();
        assert!(refused.explain().contains("exited saying GitHub refused"));
        assert!(
            f.judge("runner:dev", &facts("sha256:b", None), None)
                .is_ok()
        );
    }

    #[test]
    fn the_node_remembers_a_bounded_number_of_refused_images() {
        let f = Freshness::default();
        for i in 0..(super::REMEMBERED + 5) {
            f.rejected("runner:dev", &format!("sha256:{i}"), None);
        }
        let outdated = f.outdated();
        assert_eq!(outdated.len(), super::REMEMBERED);
        assert_eq!(outdated[0].id, "sha256:5");
    }
}
