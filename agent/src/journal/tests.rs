use std::path::Path;

use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use super::sqlite::{APPLICATION_ID, SCHEMA, sidecar};
use super::*;

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("billet-journal-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn launch(lease: &str) -> LaunchRecord {
    LaunchRecord {
        lease: lease.into(),
        epoch: 2,
        request_id: 7,
        instance: format!("billet-{lease}"),
        runner_id: 11,
        runner_name: format!("billet-{lease}"),
        created: true,
    }
}

/// The created amendment is written once the runner counts as running,
/// so it may land after the runner ended and its record was forgotten;
/// it must not bring the record back (recovery would then chase a
/// registration long removed).
#[tokio::test]
async fn an_amendment_changes_a_recorded_launch_and_never_brings_back_a_forgotten_one() {
    let d = dir();
    let sqlite = SqliteJournal::open(&d).await.unwrap();
    let memory = MemoryJournal::default();
    for j in [&sqlite as &dyn Journal, &memory] {
        let mut a = launch("a");
        a.created = false;
        j.put_launch(&a).await.unwrap();
        a.created = true;
        j.amend_launch(&a).await.unwrap();
        assert_eq!(j.launches().await.unwrap(), [a.clone()]);
        j.forget_launch("a").await.unwrap();
        j.amend_launch(&a).await.unwrap();
        assert_eq!(j.launches().await.unwrap(), [], "{j:?}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[tokio::test]
async fn a_reopened_journal_remembers_launches_custody_and_results() {
    let d = dir();
    {
        let j = SqliteJournal::open(&d).await.unwrap();
        j.put_launch(&launch("a")).await.unwrap();
        j.put_launch(&launch("b")).await.unwrap();
        j.forget_launch("b").await.unwrap();
        j.put_custody(&CustodyRecord {
            lease: "a".into(),
            epoch: 3,
            instance: "billet-a".into(),
            request_id: 7,
            registration: Some((11, "billet-a".into())),
            outcome: "failed".into(),
            phase: Some("teardown".into()),
            discard: true,
            observed: false,
            since_unix_ms: 5,
            since_boot: Some(BootStamp {
                boot_id: "boot-1".into(),
                ms: 42,
            }),
        })
        .await
        .unwrap();
        j.put_result("c1", b"xyz", Durability::Synced)
            .await
            .unwrap();
    }
    let j = SqliteJournal::open(&d).await.unwrap();
    assert_eq!(j.launches().await.unwrap(), vec![launch("a")]);
    let custody = j.custody().await.unwrap();
    assert_eq!(custody.len(), 1);
    assert_eq!(custody[0].registration, Some((11, "billet-a".into())));
    assert!(custody[0].discard);
    assert_eq!(
        j.results().await.unwrap(),
        vec![("c1".to_owned(), b"xyz".to_vec())]
    );
}

/// The boot clock is read back with its row, and only while it matches
/// the row: a release that rewrote the row without the clock (a
/// rollback, then this release again) leaves a stale one, never used.
#[tokio::test]
async fn a_custody_rows_boot_clock_is_kept_and_a_stale_one_is_ignored() {
    let d = dir();
    let j = SqliteJournal::open(&d).await.unwrap();
    let boot = BootStamp {
        boot_id: "boot-1".into(),
        ms: 42,
    };
    let record = CustodyRecord {
        lease: "a".into(),
        epoch: 1,
        instance: "billet-a".into(),
        request_id: 7,
        registration: None,
        outcome: "done".into(),
        phase: Some("teardown".into()),
        discard: false,
        observed: true,
        since_unix_ms: 5,
        since_boot: Some(boot.clone()),
    };
    j.put_custody(&record).await.unwrap();
    assert_eq!(j.custody().await.unwrap()[0].since_boot, Some(boot));
    // What an older release writes: the row, not its clock.
    sqlx::query("UPDATE custody SET since_unix_ms = 6 WHERE lease = 'a'")
        .execute(&j.pool)
        .await
        .unwrap();
    assert_eq!(j.custody().await.unwrap()[0].since_boot, None);
    j.forget_custody("a").await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM custody_clocks")
        .fetch_one(&j.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "a forgotten entry's clock outlived it");
}

#[test]
fn the_boot_clock_counts_within_one_boot_only() {
    let now = BootStamp::now().expect("a Linux host has a boot id");
    let then = now.clone().before(std::time::Duration::from_secs(10));
    assert_eq!(now.since(&then), Some(std::time::Duration::from_secs(10)));
    let other = BootStamp {
        boot_id: "another boot".into(),
        ..then
    };
    assert_eq!(now.since(&other), None);
}

#[tokio::test]
async fn the_journal_file_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir();
    SqliteJournal::open(&d).await.unwrap();
    let mode = std::fs::metadata(d.join(JOURNAL_FILE))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn a_corrupt_journal_stops_start_up_naming_the_file() {
    let d = dir();
    std::fs::write(
        d.join(JOURNAL_FILE),
        b"this is not a database, just bytes ".repeat(200),
    )
    .unwrap();
    let err = SqliteJournal::open(&d).await.unwrap_err().to_string();
    assert!(err.contains(JOURNAL_FILE), "{err}");
    // Never silently recreated.
    assert!(
        std::fs::read(d.join(JOURNAL_FILE))
            .unwrap()
            .starts_with(b"this is not")
    );
}

#[tokio::test]
async fn a_journal_made_readable_by_others_is_made_private_again() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir();
    drop(SqliteJournal::open(&d).await.unwrap());
    let path = d.join(JOURNAL_FILE);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let _j = SqliteJournal::open(&d).await.unwrap();
    for file in [path.clone(), sidecar(&path, "-wal"), sidecar(&path, "-shm")] {
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", file.display());
    }
}

/// Opens a plain SQLite database at `path` and runs `sql` in it.
async fn sqlite(path: &Path, sql: &'static str) {
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    sqlx::raw_sql(sql).execute(&pool).await.unwrap();
    pool.close().await;
}

async fn refused(d: &Path) -> String {
    let err = SqliteJournal::open(d).await.unwrap_err().to_string();
    assert!(
        err.contains(&d.join(JOURNAL_FILE).display().to_string()),
        "{err}"
    );
    err
}

#[tokio::test]
async fn an_empty_journal_file_is_refused_not_taken_for_a_fresh_one() {
    let d = dir();
    std::fs::write(d.join(JOURNAL_FILE), b"").unwrap();
    let err = refused(&d).await;
    assert!(
        err.contains("holds no journal") && err.contains("truncated"),
        "{err}"
    );
    assert_eq!(std::fs::read(d.join(JOURNAL_FILE)).unwrap(), b"");
}

#[tokio::test]
async fn another_programs_database_is_refused_and_left_as_it_was() {
    let d = dir();
    let path = d.join(JOURNAL_FILE);
    sqlite(
        &path,
        "PRAGMA application_id = 7; CREATE TABLE other (x TEXT);",
    )
    .await;
    let err = refused(&d).await;
    assert!(err.contains("another program's SQLite database"), "{err}");
    // A database without an application id and with other tables,
    // or billet's table names with other columns, is not a journal.
    let d = dir();
    let path = d.join(JOURNAL_FILE);
    sqlite(&path, "CREATE TABLE custody (x TEXT);").await;
    let err = refused(&d).await;
    assert!(
        err.contains("is not a billet node journal")
            && err.contains("table custody has columns [\"x\"]"),
        "{err}"
    );
    let pool = SqlitePoolOptions::new()
        .connect_with(SqliteConnectOptions::new().filename(&path))
        .await
        .unwrap();
    let tables: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(tables, ["custody"], "nothing was added to it");
}

#[tokio::test]
async fn a_journal_from_a_newer_release_is_refused_naming_both_schemas() {
    let d = dir();
    drop(SqliteJournal::open(&d).await.unwrap());
    sqlite(&d.join(JOURNAL_FILE), "PRAGMA user_version = 9;").await;
    let err = refused(&d).await;
    assert!(
        err.contains("journal schema 9") && err.contains("reads 1"),
        "{err}"
    );
}

#[tokio::test]
async fn a_journal_written_before_the_application_id_is_kept_and_stamped() {
    let d = dir();
    let path = d.join(JOURNAL_FILE);
    // Exactly what earlier releases wrote: the schema, no id.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(
            SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(true),
        )
        .await
        .unwrap();
    sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
    pool.close().await;
    let j = SqliteJournal::open(&d).await.unwrap();
    j.put_launch(&launch("a")).await.unwrap();
    let id: i64 = sqlx::query_scalar("PRAGMA application_id")
        .fetch_one(&j.pool)
        .await
        .unwrap();
    assert_eq!(id, APPLICATION_ID);
}

#[tokio::test]
async fn a_journal_moved_without_its_write_ahead_log_is_refused() {
    let d = dir();
    let path = d.join(JOURNAL_FILE);
    std::fs::write(sidecar(&path, "-wal"), b"frames of a journal moved away").unwrap();
    let err = refused(&d).await;
    assert!(err.contains("is missing but its write-ahead log"), "{err}");
    assert!(!path.exists(), "no journal was created beside the log");
}

#[tokio::test]
async fn an_interrupted_creation_leaves_no_journal_and_the_next_start_creates_one() {
    let d = dir();
    // What a node killed while creating the journal leaves: a partial
    // file under the staging name, never `journal.db`.
    std::fs::write(d.join(JOURNAL_FILE).with_extension("db.new"), b"partial").unwrap();
    let j = SqliteJournal::open(&d).await.unwrap();
    j.put_launch(&launch("a")).await.unwrap();
    assert!(!d.join(JOURNAL_FILE).with_extension("db.new").exists());
}

fn mount(id: &str) -> MountRecord {
    MountRecord {
        mount: id.into(),
        lease: "l1".into(),
        key: "npm".into(),
        parent: Some(7),
        policy: "cas".into(),
        committable: true,
        succeeded: false,
        since_unix_ms: 5,
    }
}

#[tokio::test]
async fn a_reopened_journal_remembers_the_cache_mounts() {
    let d = dir();
    {
        let j = SqliteJournal::open(&d).await.unwrap();
        j.put_mount(&mount("m1")).await.unwrap();
        j.put_mount(&MountRecord {
            parent: None,
            committable: false,
            ..mount("m2")
        })
        .await
        .unwrap();
        j.put_mount(&mount("m3")).await.unwrap();
        j.forget_mount("m3").await.unwrap();
        j.put_mount(&MountRecord {
            succeeded: true,
            ..mount("m1")
        })
        .await
        .unwrap();
    }
    let j = SqliteJournal::open(&d).await.unwrap();
    assert_eq!(
        j.mounts().await.unwrap(),
        vec![
            MountRecord {
                succeeded: true,
                ..mount("m1")
            },
            MountRecord {
                parent: None,
                committable: false,
                ..mount("m2")
            },
        ]
    );
}

#[tokio::test]
async fn a_journal_with_the_cache_mounts_gains_the_cache_sessions_and_stays_version_1() {
    let d = dir();
    let path = d.join(JOURNAL_FILE);
    // What the release with sticky disks and no guest API wrote.
    sqlite(
        &path,
        "PRAGMA application_id = 1651274858; PRAGMA user_version = 1;
         CREATE TABLE launches (
            lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, request_id INTEGER NOT NULL,
            instance TEXT NOT NULL, runner_id INTEGER NOT NULL, runner_name TEXT NOT NULL,
            created INTEGER NOT NULL);
         CREATE TABLE custody (
            lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, instance TEXT NOT NULL,
            request_id INTEGER NOT NULL, registration_id INTEGER, registration_name TEXT,
            outcome TEXT NOT NULL, phase TEXT, discard INTEGER NOT NULL, observed INTEGER NOT NULL,
            since_unix_ms INTEGER NOT NULL);
         CREATE TABLE results (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, command TEXT NOT NULL UNIQUE, encoded BLOB NOT NULL);
         CREATE TABLE cache_mounts (
            mount TEXT PRIMARY KEY, lease TEXT NOT NULL, key TEXT NOT NULL, parent INTEGER,
            policy TEXT NOT NULL, committable INTEGER NOT NULL, succeeded INTEGER NOT NULL,
            since_unix_ms INTEGER NOT NULL);
         INSERT INTO cache_mounts VALUES ('m1', 'l1', 'npm', 7, 'cas', 1, 0, 5);",
    )
    .await;
    assert!(SqliteJournal::check(&d).await.unwrap());
    let j = SqliteJournal::open(&d).await.unwrap();
    assert_eq!(j.mounts().await.unwrap(), vec![mount("m1")]);
    let session = SessionRecord {
        lease: "l1".into(),
        token_sha256: "ab".repeat(32),
        slots: "[]".into(),
        since_unix_ms: 9,
    };
    j.put_session(&session).await.unwrap();
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(&j.pool)
        .await
        .unwrap();
    assert_eq!(version, 1, "an added table changed the schema version");
    drop(j);
    let j = SqliteJournal::open(&d).await.unwrap();
    assert_eq!(j.sessions().await.unwrap(), vec![session]);
    j.forget_session("l1").await.unwrap();
    assert!(j.sessions().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_schema_1_journal_keeps_its_records_and_gains_the_cache_mounts() {
    let d = dir();
    let path = d.join(JOURNAL_FILE);
    // Exactly what schema 1 wrote: its three tables, stamped version 1.
    sqlite(
        &path,
        "PRAGMA application_id = 1651274858; PRAGMA user_version = 1;
         CREATE TABLE launches (
            lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, request_id INTEGER NOT NULL,
            instance TEXT NOT NULL, runner_id INTEGER NOT NULL, runner_name TEXT NOT NULL,
            created INTEGER NOT NULL);
         CREATE TABLE custody (
            lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, instance TEXT NOT NULL,
            request_id INTEGER NOT NULL, registration_id INTEGER, registration_name TEXT,
            outcome TEXT NOT NULL, phase TEXT, discard INTEGER NOT NULL, observed INTEGER NOT NULL,
            since_unix_ms INTEGER NOT NULL);
         CREATE TABLE results (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, command TEXT NOT NULL UNIQUE, encoded BLOB NOT NULL);
         INSERT INTO launches VALUES ('a', 2, 7, 'billet-a', 11, 'billet-a', 1);",
    )
    .await;
    // `billet check` reads it as it is, writing nothing.
    assert!(SqliteJournal::check(&d).await.unwrap());
    let j = SqliteJournal::open(&d).await.unwrap();
    assert_eq!(j.launches().await.unwrap(), vec![launch("a")]);
    j.put_mount(&mount("m1")).await.unwrap();
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(&j.pool)
        .await
        .unwrap();
    // Still version 1: the release before the cache checks only the
    // tables it knows, so a rollback to it reads this journal (it
    // refuses any version above its own).
    assert_eq!(version, 1, "an added table changed the schema version");
    drop(j);
    let j = SqliteJournal::open(&d).await.unwrap();
    assert_eq!(j.mounts().await.unwrap(), vec![mount("m1")]);
    let fresh = dir();
    let j = SqliteJournal::open(&fresh).await.unwrap();
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(&j.pool)
        .await
        .unwrap();
    assert_eq!(
        version, 1,
        "a new journal is stamped for the release before it"
    );
}

#[tokio::test]
async fn only_the_most_recent_results_are_kept() {
    let j = MemoryJournal::default();
    for i in 0..(RESULTS_KEPT + 10) {
        j.put_result(&format!("c{i}"), b"r", Durability::Committed)
            .await
            .unwrap();
    }
    let results = j.results().await.unwrap();
    assert_eq!(results.len(), RESULTS_KEPT as usize);
    assert_eq!(results[0].0, "c10");
}
