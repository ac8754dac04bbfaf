use super::*;
use crate::journal::{MemoryJournal, SqliteJournal};

fn dir() -> crate::cache::Scratch {
    crate::cache::Scratch::new("billet-cache")
}

/// Waits until the clock has moved past the current millisecond, so
/// the uses the test makes are ordered.
fn next_millisecond() {
    let now = now_unix_ms();
    while now_unix_ms() == now {
        std::thread::yield_now();
    }
}

fn key(k: &str) -> DiskKey {
    DiskKey::parse(k).unwrap()
}

fn lease(l: &str) -> LeaseId {
    LeaseId::parse("lease", l).unwrap()
}

async fn store(root: &Path) -> (Store, Arc<MemoryJournal>) {
    let journal = Arc::new(MemoryJournal::default());
    (
        Store::open(root, "dev", journal.clone()).await.unwrap(),
        journal,
    )
}

/// A guest's commit of a large disk must not hold the store's lock
/// while its tree is cloned, or another job's mount (its launch, and
/// the node's command slot behind it) waits for the whole copy. Another
/// key's mount asked while a commit clones 20,000 files must not wait
/// for it, and the commit still publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guests_commit_does_not_hold_another_jobs_mount_while_it_clones() {
    let d = dir();
    let (s, _) = store(&d).await;
    let big = s
        .mount(&lease("big"), &key("big"), Policy::Cas)
        .await
        .unwrap();
    for i in 0..100 {
        let dir = big.dir.join(format!("d{i}"));
        fs::create_dir(&dir).unwrap();
        for j in 0..200 {
            fs::write(dir.join(format!("f{j}")), [7u8; 4096]).unwrap();
        }
    }
    let started = std::time::Instant::now();
    let (committed, mounted) = tokio::join!(s.commit_now(&big.id), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let asked = std::time::Instant::now();
        let other = s.mount(&lease("other"), &key("other"), Policy::Cas).await;
        (other, asked.elapsed())
    });
    let commit_took = started.elapsed();
    assert!(matches!(
        committed.unwrap(),
        Committed::Published(Generation(1))
    ));
    mounted.0.unwrap();
    assert!(
        mounted.1 * 4 < commit_took,
        "the other mount took {:?} of the commit's {commit_took:?}",
        mounted.1
    );
}

/// A mount whose clone failed (its disk ran out of space) falls back
/// to an empty directory, which names no generation as its parent, so
/// the guest's `GET /v1/volumes` never reports `generation: 1` beside
/// `fallback: true`. A fallback was cloned from nothing.
#[tokio::test]
async fn a_mount_whose_clone_fails_names_no_parent_generation() {
    let d = dir();
    let (s, journal) = store(&d).await;
    publish(&s, "l1", "npm", "1").await;
    fs::remove_dir_all(s.generation_dir(&key("npm"), Generation(1))).unwrap();
    let m = s
        .mount(&lease("l2"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert!(!m.committable);
    assert_eq!(m.parent, None, "a fallback names no parent");
    let records = journal.mounts().await.unwrap();
    let record = records.iter().find(|r| r.mount == m.id).unwrap();
    assert_eq!(record.parent, None, "nor does its journal record");
}

/// Mounts `k` for `l`, writes `counter` into it, marks it succeeded and
/// settles it.
async fn publish(s: &Store, l: &str, k: &str, counter: &str) -> Settled {
    let m = s.mount(&lease(l), &key(k), Policy::Cas).await.unwrap();
    fs::write(m.dir.join("counter"), counter).unwrap();
    s.mark_succeeded(&lease(l)).await.unwrap();
    let settled = s.settle(&lease(l)).await;
    assert_eq!(settled.len(), 1);
    settled.into_iter().next().unwrap().1.unwrap()
}

#[tokio::test]
async fn a_cold_mount_is_an_empty_committable_directory_whose_commit_is_the_first_generation() {
    let root = dir();
    let (s, journal) = store(&root).await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!((m.parent, m.committable), (None, true));
    assert_eq!(fs::read_dir(&m.dir).unwrap().count(), 0);
    // Journaled before the job could use it.
    assert_eq!(journal.mounts().await.unwrap().len(), 1);
    fs::write(m.dir.join("counter"), "1").unwrap();
    assert_eq!(
        s.commit(&m.id).await.unwrap(),
        Committed::Published(Generation(1))
    );
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(1)));
    assert!(!m.dir.exists(), "the mount became the generation");
    assert!(journal.mounts().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_second_mount_finds_what_the_first_committed_and_cannot_change_it() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l1", "npm", "1").await;
    let m = s
        .mount(&lease("l2"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!(m.parent, Some(Generation(1)));
    assert_eq!(fs::read_to_string(m.dir.join("counter")).unwrap(), "1");
    fs::write(m.dir.join("counter"), "2").unwrap();
    let g1 = s.generation_dir(&key("npm"), Generation(1));
    assert_eq!(fs::read_to_string(g1.join("counter")).unwrap(), "1");
    s.mark_succeeded(&lease("l2")).await.unwrap();
    s.settle(&lease("l2")).await;
    let m = s
        .mount(&lease("l3"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!(m.parent, Some(Generation(2)));
    assert_eq!(fs::read_to_string(m.dir.join("counter")).unwrap(), "2");
    // Another key, and the same key of another deployment, are apart.
    let other = s
        .mount(&lease("l3"), &key("go"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!(other.parent, None);
    drop(s);
    let (s2, _) = {
        let journal = Arc::new(MemoryJournal::default());
        (
            Store::open(&root, "prod", journal.clone()).await.unwrap(),
            journal,
        )
    };
    assert_eq!(s2.head(&key("npm")).await.unwrap(), None);
}

#[tokio::test]
async fn two_jobs_that_mounted_one_generation_commit_in_turn_and_the_second_is_a_conflict() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "npm", "7").await;
    let a = s
        .mount(&lease("la"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    let b = s
        .mount(&lease("lb"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    fs::write(a.dir.join("counter"), "a").unwrap();
    fs::write(b.dir.join("counter"), "b").unwrap();
    assert_eq!(
        s.commit(&a.id).await.unwrap(),
        Committed::Published(Generation(2))
    );
    assert_eq!(
        s.commit(&b.id).await.unwrap(),
        Committed::Conflict {
            parent: Some(Generation(1)),
            head: Some(Generation(2)),
        }
    );
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(2)));
    let g2 = s.generation_dir(&key("npm"), Generation(2));
    assert_eq!(fs::read_to_string(g2.join("counter")).unwrap(), "a");
    assert!(!b.dir.exists(), "the rejected mount is discarded");
    // Two cold mounts too: the first commit makes the key, the second
    // conflicts with it.
    let c = s
        .mount(&lease("lc"), &key("go"), Policy::Cas)
        .await
        .unwrap();
    let d = s
        .mount(&lease("ld"), &key("go"), Policy::Cas)
        .await
        .unwrap();
    assert!(matches!(
        s.commit(&c.id).await.unwrap(),
        Committed::Published(_)
    ));
    assert!(matches!(
        s.commit(&d.id).await.unwrap(),
        Committed::Conflict { .. }
    ));
}

#[tokio::test]
async fn under_last_writer_wins_the_second_commit_becomes_the_head() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "buildkit", "7").await;
    let a = s
        .mount(&lease("la"), &key("buildkit"), Policy::LastWriterWins)
        .await
        .unwrap();
    let b = s
        .mount(&lease("lb"), &key("buildkit"), Policy::LastWriterWins)
        .await
        .unwrap();
    fs::write(a.dir.join("counter"), "a").unwrap();
    fs::write(b.dir.join("counter"), "b").unwrap();
    assert_eq!(
        s.commit(&a.id).await.unwrap(),
        Committed::Published(Generation(2))
    );
    assert_eq!(
        s.commit(&b.id).await.unwrap(),
        Committed::Published(Generation(3))
    );
    let g3 = s.generation_dir(&key("buildkit"), Generation(3));
    assert_eq!(fs::read_to_string(g3.join("counter")).unwrap(), "b");
}

#[tokio::test]
async fn a_failed_mount_is_an_empty_directory_that_is_never_committed() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "npm", "1").await;
    // The generation's tree is lost under the store.
    fs::remove_dir_all(s.generation_dir(&key("npm"), Generation(1))).unwrap();
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert!(!m.committable);
    assert_eq!(fs::read_dir(&m.dir).unwrap().count(), 0);
    fs::write(m.dir.join("counter"), "junk").unwrap();
    s.mark_succeeded(&lease("l1")).await.unwrap();
    let settled = s.settle(&lease("l1")).await;
    assert_eq!(
        settled[0].1.as_ref().unwrap(),
        &Settled::Committed(Committed::NotCommittable)
    );
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(1)));
    assert!(!m.dir.exists());
}

#[tokio::test]
async fn each_jobs_hits_misses_bytes_conflicts_and_fallbacks_are_counted_once_and_summed() {
    let root = dir();
    let (s, _) = store(&root).await;
    // A cold mount whose commit publishes 5 bytes.
    publish(&s, "l0", "npm", "12345").await;
    assert_eq!(
        s.take_observation(&lease("l0")),
        Some(Observation {
            misses: 1,
            bytes_committed: 5,
            ..Observation::default()
        })
    );
    assert_eq!(s.take_observation(&lease("l0")), None, "taken once");
    // Two jobs hit generation 1 (5 bytes each) and add 3 bytes; the
    // first publishes 8 bytes by its guest's commit (a copy), the
    // second is a conflict.
    let a = s
        .mount(&lease("la"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    let b = s
        .mount(&lease("lb"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    fs::write(a.dir.join("more"), "abc").unwrap();
    fs::write(b.dir.join("more"), "abc").unwrap();
    assert!(matches!(
        s.commit_now(&a.id).await.unwrap(),
        Committed::Published(Generation(2))
    ));
    assert!(matches!(
        s.commit(&b.id).await.unwrap(),
        Committed::Conflict { .. }
    ));
    s.settle(&lease("la")).await;
    assert_eq!(
        s.take_observation(&lease("la")),
        Some(Observation {
            hits: 1,
            bytes_restored: 5,
            bytes_committed: 8,
            ..Observation::default()
        })
    );
    assert_eq!(
        s.take_observation(&lease("lb")),
        Some(Observation {
            hits: 1,
            bytes_restored: 5,
            conflicts: 1,
            ..Observation::default()
        })
    );
    // A fallback (the head's tree lost) publishes nothing.
    fs::remove_dir_all(s.generation_dir(&key("npm"), Generation(2))).unwrap();
    s.mount(&lease("lf"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    s.mark_succeeded(&lease("lf")).await.unwrap();
    s.settle(&lease("lf")).await;
    assert_eq!(
        s.take_observation(&lease("lf")),
        Some(Observation {
            fallbacks: 1,
            ..Observation::default()
        })
    );
    assert_eq!(
        s.totals(),
        Observation {
            hits: 2,
            misses: 1,
            bytes_restored: 10,
            bytes_committed: 13,
            conflicts: 1,
            fallbacks: 1,
        },
        "the totals keep what was taken"
    );
}

#[tokio::test]
async fn a_job_that_did_not_succeed_publishes_nothing() {
    let root = dir();
    let (s, journal) = store(&root).await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    fs::write(m.dir.join("counter"), "1").unwrap();
    let settled = s.settle(&lease("l1")).await;
    assert_eq!(settled[0].1.as_ref().unwrap(), &Settled::Discarded);
    assert_eq!(s.head(&key("npm")).await.unwrap(), None);
    assert!(!m.dir.exists());
    assert!(journal.mounts().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_commit_that_fails_midway_leaves_the_head_at_the_previous_generation_intact() {
    let root = dir();
    let (s, journal) = store(&root).await;
    publish(&s, "l0", "npm", "1").await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    fs::write(m.dir.join("counter"), "2").unwrap();
    // The new state cannot be written: the commit fails after the
    // mount was renamed to generation 2.
    let temp = root
        .join("keys")
        .join(s.dirs.key_dir("npm").file_name().unwrap())
        .join(STATE_TEMP);
    fs::create_dir(&temp).unwrap();
    assert!(matches!(
        s.commit(&m.id).await,
        Err(CacheError::Io { op: "create", .. })
    ));
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(1)));
    let g1 = s.generation_dir(&key("npm"), Generation(1));
    assert_eq!(fs::read_to_string(g1.join("counter")).unwrap(), "1");
    assert!(
        !s.generation_dir(&key("npm"), Generation(2)).exists(),
        "the half-made generation is collected"
    );
    assert!(!m.dir.exists());
    assert!(journal.mounts().await.unwrap().is_empty());
    fs::remove_dir(&temp).unwrap();
    let m = s
        .mount(&lease("l2"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!(fs::read_to_string(m.dir.join("counter")).unwrap(), "1");
}

#[tokio::test]
async fn a_crash_between_the_rename_and_the_state_leaves_a_generation_collected_on_open() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "npm", "1").await;
    // What a node killed between the two steps leaves: a tree under
    // the next generation's name that no state names.
    let g2 = s.generation_dir(&key("npm"), Generation(2));
    fs::create_dir_all(&g2).unwrap();
    fs::write(g2.join("counter"), "partial").unwrap();
    drop(s);
    let (s, _) = store(&root).await;
    assert!(!g2.exists());
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(1)));
    assert!(matches!(
        publish(&s, "l1", "npm", "2").await,
        Settled::Committed(Committed::Published(Generation(2)))
    ));
}

#[tokio::test]
async fn eviction_never_removes_a_generation_a_mount_was_cloned_from() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "npm", "1").await;
    publish(&s, "l0", "go", "1").await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    // Everything is past its retention.
    let all = Eviction {
        retention: Duration::ZERO,
        budget_bytes: Some(0),
        ..Eviction::default()
    };
    let report = s.evict(all, now_unix_ms() + 1).await.unwrap();
    assert_eq!(report.removed, vec![("go".to_owned(), Generation(1))]);
    assert_eq!(report.kept_mounted, 1);
    assert!(s.generation_dir(&key("npm"), Generation(1)).exists());
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(1)));
    // Once the mount is gone, so is its generation.
    s.discard(&m.id).await.unwrap();
    let report = s.evict(all, now_unix_ms() + 1).await.unwrap();
    assert_eq!(report.removed, vec![("npm".to_owned(), Generation(1))]);
    assert_eq!(s.head(&key("npm")).await.unwrap(), None);
    // A key that lost its head starts cold, with a new number.
    assert!(matches!(
        publish(&s, "l2", "npm", "x").await,
        Settled::Committed(Committed::Published(Generation(2)))
    ));
}

#[tokio::test]
async fn a_superseded_generation_goes_once_no_mount_holds_it_and_a_fresh_head_stays() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "npm", "1").await;
    let held = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    publish(&s, "l2", "npm", "2").await;
    let rules = Eviction::default();
    let report = s.evict(rules, now_unix_ms()).await.unwrap();
    assert!(report.removed.is_empty(), "g1 is mounted: {report:?}");
    s.discard(&held.id).await.unwrap();
    let report = s.evict(rules, now_unix_ms()).await.unwrap();
    assert_eq!(report.removed, vec![("npm".to_owned(), Generation(1))]);
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(2)));
    assert!(s.generation_dir(&key("npm"), Generation(2)).exists());
}

#[tokio::test]
async fn over_its_byte_budget_the_cache_evicts_the_least_recently_used_first() {
    let root = dir();
    let (s, _) = store(&root).await;
    for k in ["old", "mid", "new"] {
        let m = s.mount(&lease("l0"), &key(k), Policy::Cas).await.unwrap();
        fs::write(m.dir.join("blob"), vec![1u8; 64 << 10]).unwrap();
        s.commit(&m.id).await.unwrap();
        next_millisecond();
    }
    // Used in the order old, mid, new: "old" is mounted (and
    // discarded) again last, so "mid" is the least recently used.
    let m = s
        .mount(&lease("l1"), &key("old"), Policy::Cas)
        .await
        .unwrap();
    s.discard(&m.id).await.unwrap();
    let one = tree_bytes(&s.generation_dir(&key("new"), Generation(1))).unwrap();
    let rules = Eviction {
        retention: Duration::from_secs(3600),
        budget_bytes: Some(2 * one + one / 2),
        ..Eviction::default()
    };
    let report = s.evict(rules, now_unix_ms()).await.unwrap();
    assert_eq!(report.removed, vec![("mid".to_owned(), Generation(1))]);
    assert!(report.freed_bytes >= 64 << 10);
    assert_eq!(s.head(&key("old")).await.unwrap(), Some(Generation(1)));
    assert_eq!(s.head(&key("new")).await.unwrap(), Some(Generation(1)));
}

#[tokio::test]
async fn a_restarted_node_still_owns_what_its_guests_mounted() {
    let root = dir();
    let state = dir();
    let journal = Arc::new(SqliteJournal::open(&state).await.unwrap());
    let s = Store::open(&root, "dev", journal.clone()).await.unwrap();
    publish(&s, "l0", "npm", "1").await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    fs::write(m.dir.join("counter"), "2").unwrap();
    s.mark_succeeded(&lease("l1")).await.unwrap();
    // A mount directory nobody journaled (a crash before the intent).
    fs::create_dir(root.join("mounts").join("stray")).unwrap();
    drop(s);
    drop(journal);
    let journal = Arc::new(SqliteJournal::open(&state).await.unwrap());
    let s = Store::open(&root, "dev", journal).await.unwrap();
    assert!(!root.join("mounts/stray").exists());
    assert_eq!(s.mounts().await.len(), 1);
    // Its generation is still protected, and its end still commits.
    let report = s
        .evict(
            Eviction {
                retention: Duration::ZERO,
                budget_bytes: Some(0),
                ..Eviction::default()
            },
            now_unix_ms() + 1,
        )
        .await
        .unwrap();
    assert!(report.removed.is_empty(), "{report:?}");
    let settled = s.settle(&lease("l1")).await;
    assert_eq!(
        settled[0].1.as_ref().unwrap(),
        &Settled::Committed(Committed::Published(Generation(2)))
    );
    // A lease the restarted node no longer holds has its mounts dropped.
    let stale = s
        .mount(&lease("l9"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!(s.reconcile(&Listed::new([], ["l1".to_owned()])).await, 1);
    assert!(!stale.dir.exists());
    assert!(s.mounts().await.is_empty());
}

#[tokio::test]
async fn a_mount_listed_or_held_stays_and_one_whose_discard_failed_goes_at_the_next_inventory() {
    let root = dir();
    let (s, journal) = store(&root).await;
    let listed = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    let held = s
        .mount(&lease("l2"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    let ended = s
        .mount(&lease("l3"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    // The job of l3 ended, but its mount cannot be removed (the trash
    // is not a directory): settling it fails and keeps it.
    let trash = root.join("trash");
    fs::rename(&trash, root.join("trash.away")).unwrap();
    fs::write(&trash, "").unwrap();
    let settled = s.settle(&lease("l3")).await;
    assert!(settled[0].1.is_err(), "{settled:?}");
    assert_eq!(s.mounts().await.len(), 3);
    fs::remove_file(&trash).unwrap();
    fs::rename(root.join("trash.away"), &trash).unwrap();
    // The next inventory lists l1's instance, the runner holds l2, and
    // l3 is neither: its mount goes, the others stay.
    let inventory = Listed::new(["l1".to_owned()], ["l2".to_owned()]);
    assert_eq!(s.reconcile(&inventory).await, 1);
    assert!(!ended.dir.exists());
    assert!(listed.dir.exists() && held.dir.exists());
    let left: Vec<String> = journal
        .mounts()
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.lease)
        .collect();
    assert_eq!(left, ["l1", "l2"]);
}

#[tokio::test]
async fn a_long_jobs_mounted_generation_outlives_the_retention_and_counts_as_used_until_it_ends() {
    let root = dir();
    let (s, _) = store(&root).await;
    publish(&s, "l0", "npm", "1").await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    let rules = Eviction {
        retention: hour,
        budget_bytes: None,
        ..Eviction::default()
    };
    // Two hours later the job still runs: its generation stays, and is
    // renewed as used then.
    let later = now_unix_ms() + 2 * 3_600_000;
    let report = s.evict(rules, later).await.unwrap();
    assert_eq!((report.removed.len(), report.kept_mounted), (0, 1));
    s.discard(&m.id).await.unwrap();
    // Half an hour after that (the job ended meanwhile) it is within
    // the retention from its renewal, not from its mount.
    let report = s.evict(rules, later + 1_800_000).await.unwrap();
    assert!(report.removed.is_empty(), "{report:?}");
    assert_eq!(s.head(&key("npm")).await.unwrap(), Some(Generation(1)));
    // An hour after the renewal it goes, and the store counts it.
    let report = s.evict(rules, later + 3_600_000).await.unwrap();
    assert_eq!(report.removed, vec![("npm".to_owned(), Generation(1))]);
    assert_eq!(
        s.evicted(),
        crate::cache::Evicted {
            generations: 1,
            archives: 0,
            bytes: report.freed_bytes
        }
    );
    assert!(report.freed_bytes > 0);
}

/// A Docker image store's generation is kept for its own retention
/// (192 h by default) after its last use, whatever the general
/// retention is, longer or shorter (spec/cache.md §1.2, §4.2).
#[tokio::test]
async fn the_docker_image_store_keeps_its_own_retention_whatever_the_general_one() {
    let root = dir();
    let (s, _) = store(&root).await;
    let images = DiskKey::docker_images("amd64").unwrap();
    let commit = |k: DiskKey| {
        let s = &s;
        async move {
            let m = s
                .mount(&lease("l0"), &k, Policy::LastWriterWins)
                .await
                .unwrap();
            fs::write(m.dir.join("layer"), "x").unwrap();
            s.commit(&m.id).await.unwrap()
        }
    };
    assert_eq!(
        commit(images.clone()).await,
        Committed::Published(Generation(1))
    );
    publish(&s, "l0", "npm", "1").await;
    let hour = 3_600_000;
    let t0 = now_unix_ms();
    assert_eq!(
        Eviction::default().image_store_retention.as_secs(),
        192 * 3600
    );
    let rules = Eviction {
        retention: Duration::from_secs(3600),
        image_store_retention: Duration::from_secs(8 * 3600),
        budget_bytes: None,
    };
    // Two hours unused: past the general retention, not the store's.
    let report = s.evict(rules, t0 + 2 * hour).await.unwrap();
    assert_eq!(report.removed, vec![("npm".to_owned(), Generation(1))]);
    assert_eq!(s.head(&images).await.unwrap(), Some(Generation(1)));
    // Eight hours unused: the store goes too.
    let report = s.evict(rules, t0 + 8 * hour + 1).await.unwrap();
    assert_eq!(
        report.removed,
        vec![(images.as_str().to_owned(), Generation(1))]
    );
    assert_eq!(s.head(&images).await.unwrap(), None);
    // A general retention longer than the store's does not keep it.
    assert_eq!(
        commit(images.clone()).await,
        Committed::Published(Generation(2))
    );
    publish(&s, "l1", "go", "1").await;
    let t1 = now_unix_ms();
    let rules = Eviction {
        retention: Duration::from_secs(10 * 3600),
        image_store_retention: Duration::from_secs(3600),
        budget_bytes: None,
    };
    let report = s.evict(rules, t1 + 2 * hour).await.unwrap();
    assert_eq!(
        report.removed,
        vec![(images.as_str().to_owned(), Generation(2))]
    );
    assert_eq!(s.head(&key("go")).await.unwrap(), Some(Generation(1)));
}

/// A seam for the walk: the first time it is called it says so on
/// `walking` and waits for `go` (for at most a minute, after which it
/// records that it was not let go and walks on).
fn pausing_seam() -> (
    WalkSeam,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let (walking_tx, walking) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let stuck = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let first = std::sync::Once::new();
    let go_rx = std::sync::Mutex::new(go_rx);
    let flag = stuck.clone();
    let seam: WalkSeam = Arc::new(move || {
        first.call_once(|| {
            let _ = walking_tx.send(());
            let waited = go_rx.lock().unwrap().recv_timeout(Duration::from_secs(60));
            if waited.is_err() {
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        });
    });
    (seam, walking, go, stuck)
}

/// An eviction pass walks every generation without the store's lock.
/// While a pass is paused in its walk (a seam), a mount of another key
/// and a commit complete; the walk is let go only after them. Held
/// under the lock, the walk would wait out its seam's bound first and
/// the mount would complete after it.
#[tokio::test]
async fn a_mount_and_a_commit_complete_while_an_eviction_pass_walks() {
    let root = dir();
    let s = Arc::new(store(&root).await.0);
    for k in ["a", "b", "c"] {
        publish(&s, "l0", k, "1").await;
    }
    let (seam, walking, go, stuck) = pausing_seam();
    let pass = {
        let s = s.clone();
        tokio::spawn(async move {
            super::super::lifecycle::evict_walking(
                &s,
                None,
                Eviction::default(),
                now_unix_ms(),
                Some(seam),
            )
            .await
        })
    };
    tokio::task::spawn_blocking(move || walking.recv().unwrap())
        .await
        .unwrap();
    // The pass is in its walk.
    let m = s.mount(&lease("l1"), &key("b"), Policy::Cas).await.unwrap();
    assert_eq!(m.parent, Some(Generation(1)));
    fs::write(m.dir.join("counter"), "2").unwrap();
    assert_eq!(
        s.commit(&m.id).await.unwrap(),
        Committed::Published(Generation(2))
    );
    go.send(()).unwrap();
    let report = pass.await.unwrap().unwrap();
    assert!(
        !stuck.load(std::sync::atomic::Ordering::SeqCst),
        "the walk waited out its bound: the mount waited for the walk"
    );
    // The walk read b's state before or after the commit; either way
    // nothing of b's head goes.
    assert!(
        !report
            .removed
            .iter()
            .any(|(k, g)| k == "b" && *g == Generation(2)),
        "{report:?}"
    );
    assert_eq!(s.head(&key("b")).await.unwrap(), Some(Generation(2)));
}

/// A generation the walk chose (least recently used, over the budget)
/// that a job mounts while the walk goes on is looked at again under
/// the lock and kept; its mount clones it whole.
#[tokio::test]
async fn a_victim_mounted_while_the_pass_walks_is_kept_when_its_removal_looks_again() {
    let root = dir();
    let s = Arc::new(store(&root).await.0);
    publish(&s, "l0", "old", "1").await;
    next_millisecond();
    publish(&s, "l0", "new", "1").await;
    let one = tree_bytes(&s.generation_dir(&key("new"), Generation(1))).unwrap();
    let (seam, walking, go, stuck) = pausing_seam();
    // Room for one of the two: the least recently used, old, must go.
    let rules = Eviction {
        budget_bytes: Some(one + one / 2),
        ..Eviction::default()
    };
    let pass = {
        let s = s.clone();
        tokio::spawn(async move {
            super::super::lifecycle::evict_walking(&s, None, rules, now_unix_ms(), Some(seam)).await
        })
    };
    tokio::task::spawn_blocking(move || walking.recv().unwrap())
        .await
        .unwrap();
    let m = s
        .mount(&lease("l1"), &key("old"), Policy::Cas)
        .await
        .unwrap();
    go.send(()).unwrap();
    let report = pass.await.unwrap().unwrap();
    assert!(!stuck.load(std::sync::atomic::Ordering::SeqCst));
    assert!(
        report.removed.is_empty(),
        "old was the least recently used when walked, and mounted since: {report:?}"
    );
    assert_eq!(report.kept_used_since, 1, "{report:?}");
    assert!(report.kept_bytes > one + one / 2, "{report:?}");
    assert!(s.generation_dir(&key("old"), Generation(1)).exists());
    assert_eq!(fs::read_to_string(m.dir.join("counter")).unwrap(), "1");
    assert_eq!(s.head(&key("old")).await.unwrap(), Some(Generation(1)));
}

#[tokio::test]
async fn the_store_says_which_file_system_it_is_on_and_how_it_clones() {
    let root = dir();
    let (s, _) = store(&root).await;
    let fs = s.filesystem();
    assert_eq!(
        fs.kind,
        crate::cache::clone::filesystem_kind(&root).unwrap()
    );
    assert_eq!(s.reflinks(), Some(fs.reflink), "learnt before any mount");
    // What the probe said is what a mount does.
    publish(&s, "l0", "npm", "1").await;
    let m = s
        .mount(&lease("l1"), &key("npm"), Policy::Cas)
        .await
        .unwrap();
    assert_eq!(m.method, Some(fs.method()));
    assert_eq!(fs::read_dir(root.join("trash")).unwrap().count(), 0);
}

#[tokio::test]
async fn a_second_store_on_one_directory_is_refused() {
    let root = dir();
    let (_s, _) = store(&root).await;
    let err = Store::open(&root, "dev", Arc::new(MemoryJournal::default()))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("in use by another process"),
        "{err}"
    );
}
