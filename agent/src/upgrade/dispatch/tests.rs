use super::*;
use std::sync::Arc;
use std::time::Instant;

use billet_proto::v1 as pb;
use tokio::sync::mpsc;

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        // Short: an answer socket's whole path in it must fit in 107 bytes.
        let random = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("billet-up-{}", &random[..12]));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    /// Writes an executable `/bin/sh` script `updater` running `body` in
    /// this directory (its working directory), and returns its path.
    fn script(&self, body: &str) -> PathBuf {
        self.script_named("updater", body)
    }

    /// Writes an executable `/bin/sh` script `name` running `body` in
    /// this directory (its working directory), and returns its path.
    fn script_named(&self, name: &str, body: &str) -> PathBuf {
        let path = self.0.join(name);
        let text = format!("#!/bin/sh\ncd '{}' || exit 1\n{body}\n", self.0.display());
        std::fs::write(&path, text).expect("write script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .expect("chmod script");
        path
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills, on drop, the process group a script recorded in `pid`.
struct Group(i32);

impl Drop for Group {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0)])
            .stderr(Stdio::null())
            .status();
    }
}

fn spec(version: &str) -> UpgradeSpec {
    UpgradeSpec {
        version: version.into(),
        manifest_sha256: None,
        rollout_id: None,
        generation: 0,
    }
}

fn upgrader(binary: PathBuf, ack_wait: Duration) -> ExecUpgrader {
    ExecUpgrader {
        binary,
        config: None,
        ack_wait,
        dispatch: Dispatch::Detached,
    }
}

/// Starts the upgrade, retrying only the spawn failure `ETXTBSY`: a
/// script just written can be briefly "busy" while another test thread
/// forks with the write descriptor open (it closes at that child's exec).
async fn start_upgrade(up: &ExecUpgrader, spec: &UpgradeSpec) -> Result<(), UpgradeError> {
    const ETXTBSY: i32 = 26;
    let mut tries = 0;
    loop {
        match up.start_upgrade(spec).await {
            Err(UpgradeError::Spawn { source, .. })
                if (source.raw_os_error() == Some(ETXTBSY)
                    || source.kind() == io::ErrorKind::ExecutableFileBusy)
                    && tries < 50 =>
            {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
}

/// Waits, with a bound, until `path` holds a complete line, and returns
/// its contents trimmed.
async fn wait_for_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text.trim().to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "{} was not written within 10s",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn refusal(r: Result<(), UpgradeError>) -> (Refusal, String) {
    match r {
        Err(e @ UpgradeError::Refused { .. }) => {
            let message = e.to_string();
            let UpgradeError::Refused { refusal, .. } = e else {
                unreachable!()
            };
            (refusal, message)
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test]
async fn an_updater_that_says_accepted_takes_the_upgrade() {
    let dir = TempDir::new();
    let up = upgrader(dir.script("printf 'accepted\\n' >&3"), DEFAULT_ACK_WAIT);
    start_upgrade(&up, &spec("1.2.3")).await.expect("accepted");
}

#[tokio::test]
async fn accepted_with_surrounding_blanks_is_still_accepted_but_not_without_its_newline() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("printf '  accepted \\r\\n' >&3"),
        DEFAULT_ACK_WAIT,
    );
    start_upgrade(&up, &spec("1.2.3")).await.expect("accepted");

    let up = upgrader(dir.script("printf 'accepted' >&3"), DEFAULT_ACK_WAIT);
    let (refusal, _) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
    assert_eq!(refusal, Refusal::Partway);
}

#[tokio::test]
async fn an_updater_that_refuses_gives_its_reason() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("printf 'refused: the manifest digest does not match\\n' >&3"),
        DEFAULT_ACK_WAIT,
    );
    let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
    assert_eq!(
        refusal,
        Refusal::Said("the manifest digest does not match".into())
    );
    assert_eq!(
        message,
        "the updater refused to install 1.2.3: the manifest digest does not match"
    );
}

#[tokio::test]
async fn an_updater_silent_past_the_ack_wait_is_refused_as_maybe_still_working() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("echo $$ > pid\nsleep 20"),
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let r = start_upgrade(&up, &spec("1.2.3")).await;
    let elapsed = started.elapsed();
    let _group = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));
    let (refusal, message) = refusal(r);
    assert_eq!(refusal, Refusal::Silent(Duration::from_secs(1)));
    assert!(message.contains("did not say within 1s"), "{message}");
    assert!(message.contains("may still be working"), "{message}");
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(5),
        "returned after {elapsed:?}, not at the 1s bound"
    );
}

#[tokio::test]
async fn an_updater_that_stops_partway_through_its_answer_is_refused_as_such() {
    let dir = TempDir::new();
    let up = upgrader(dir.script("printf 'accep' >&3\nexit 0"), DEFAULT_ACK_WAIT);
    let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
    assert_eq!(refusal, Refusal::Partway);
    assert!(
        message.contains("stopped partway through its answer"),
        "{message}"
    );
}

#[tokio::test]
async fn an_updater_that_exits_without_a_word_is_refused_as_such() {
    let dir = TempDir::new();
    let up = upgrader(dir.script("exit 3"), DEFAULT_ACK_WAIT);
    let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
    assert_eq!(refusal, Refusal::WithoutWord);
    assert!(message.contains("stopped without saying why"), "{message}");
}

#[tokio::test]
async fn an_oversize_answer_is_refused_as_not_an_answer() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("head -c 5000 /dev/zero | tr '\\0' x >&3\nsleep 1"),
        DEFAULT_ACK_WAIT,
    );
    let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
    assert_eq!(refusal, Refusal::Oversize);
    assert!(message.contains("ran past 4096 bytes"), "{message}");
}

#[tokio::test]
async fn an_answer_of_exactly_the_limit_is_still_a_line() {
    let dir = TempDir::new();
    // 9 bytes of prefix + 4087 of reason = 4096, then the newline.
    let up = upgrader(
        dir.script(
            "{ printf 'refused: '; head -c 4087 /dev/zero | tr '\\0' y; printf '\\n'; } >&3",
        ),
        DEFAULT_ACK_WAIT,
    );
    let (refusal, _) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
    assert_eq!(refusal, Refusal::Said("y".repeat(4087)));
}

#[tokio::test]
async fn the_distinct_refusals_have_distinct_messages() {
    let messages: Vec<String> = [
        Refusal::Said("no".into()),
        Refusal::Silent(DEFAULT_ACK_WAIT),
        Refusal::Partway,
        Refusal::WithoutWord,
        Refusal::Oversize,
    ]
    .iter()
    .map(|r| r.describe("1.2.3"))
    .collect();
    for (i, a) in messages.iter().enumerate() {
        for b in &messages[i + 1..] {
            assert_ne!(a, b);
        }
    }
    assert!(
        messages[1].contains("did not say within 90s"),
        "{}",
        messages[1]
    );
}

#[tokio::test]
async fn the_argv_names_every_fence_that_is_set() {
    let dir = TempDir::new();
    let mut up = upgrader(
        dir.script(
            "for a in \"$@\"; do printf '%s\\n' \"$a\"; done > args\nprintf 'accepted\\n' >&3",
        ),
        DEFAULT_ACK_WAIT,
    );
    up.config = Some("/etc/billet/upgrade.toml".into());
    let digest = "ab".repeat(32);
    let spec = UpgradeSpec {
        version: "1.2.3".into(),
        manifest_sha256: Some(digest.clone()),
        rollout_id: Some("rollout-7".into()),
        generation: 4,
    };
    start_upgrade(&up, &spec).await.expect("accepted");
    let args = std::fs::read_to_string(dir.path("args")).expect("args");
    assert_eq!(
        args.lines().collect::<Vec<_>>(),
        [
            "host-upgrade",
            "--version",
            "1.2.3",
            "--manifest-sha256",
            &digest,
            "--rollout",
            "rollout-7",
            "--generation",
            "4",
            "--config",
            "/etc/billet/upgrade.toml",
            "--ack-fd",
            "3"
        ]
    );
}

#[tokio::test]
async fn the_argv_omits_empty_fences_and_never_passes_them_empty() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script(
            "for a in \"$@\"; do printf '[%s]\\n' \"$a\"; done > args\nprintf 'accepted\\n' >&3",
        ),
        DEFAULT_ACK_WAIT,
    );
    for spec in [
        spec("1.2.3"),
        UpgradeSpec {
            version: "1.2.3".into(),
            manifest_sha256: Some(String::new()),
            rollout_id: Some(String::new()),
            generation: 0,
        },
    ] {
        start_upgrade(&up, &spec).await.expect("accepted");
        let args = std::fs::read_to_string(dir.path("args")).expect("args");
        assert_eq!(
            args.lines().collect::<Vec<_>>(),
            [
                "[host-upgrade]",
                "[--version]",
                "[1.2.3]",
                "[--ack-fd]",
                "[3]"
            ],
            "for {spec:?}"
        );
        assert!(!args.contains("[]"), "an empty argument was passed");
    }
}

#[test]
fn a_value_that_would_read_as_a_flag_is_never_passed() {
    let up = ExecUpgrader::new("/nonexistent/billet");
    let mut s = spec("--config");
    assert!(matches!(
        up.argv(&s),
        Err(UpgradeError::Spec {
            field: "version",
            ..
        })
    ));
    s.version = "1.2.3".into();
    s.rollout_id = Some("-x".into());
    assert!(matches!(
        up.argv(&s),
        Err(UpgradeError::Spec {
            field: "rollout_id",
            ..
        })
    ));
}

#[tokio::test]
async fn an_updater_that_cannot_be_started_is_a_spawn_error() {
    let up = ExecUpgrader::new("/nonexistent/billet");
    let r = up.start_upgrade(&spec("1.2.3")).await;
    assert!(matches!(r, Err(UpgradeError::Spawn { .. })), "{r:?}");
}

#[tokio::test]
async fn a_node_without_an_updater_says_to_upgrade_it_out_of_band() {
    let e = start(None, &spec("1.2.3")).await.expect_err("refused");
    assert!(matches!(e, UpgradeError::NoUpgrader { .. }));
    assert_eq!(
        e.to_string(),
        "this node has no transactional updater, so it cannot install 1.2.3; upgrade it out of band (replace the billet binary and restart the service)"
    );
}

fn pgid_of(pid: u32) -> i32 {
    let out = std::process::Command::new("ps")
        .args(["-o", "pgid=", "-p", &pid.to_string()])
        .output()
        .expect("this test needs ps(1) to read process groups");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("a process group id")
}

fn alive(pid: i32) -> bool {
    // A zombie still has a /proc entry; it is not alive.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

#[test]
fn the_updater_runs_in_its_own_process_group_and_outlives_the_node_side() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("echo $$ > pid\nps -o pgid= -p $$ > pgid\nprintf 'accepted\\n' >&3\nsleep 30"),
        DEFAULT_ACK_WAIT,
    );
    // The node side: a runtime of its own, dropped once the updater has
    // answered, as a node stopping would drop everything it runs.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let started = Instant::now();
    runtime
        .block_on(start_upgrade(&up, &spec("1.2.3")))
        .expect("accepted");
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(runtime);
    drop(up);

    let pid: i32 = std::fs::read_to_string(dir.path("pid"))
        .expect("pid")
        .trim()
        .parse()
        .expect("pid");
    let _group = Group(pid);
    let pgid: i32 = std::fs::read_to_string(dir.path("pgid"))
        .expect("pgid")
        .trim()
        .parse()
        .expect("pgid");
    assert_eq!(pgid, pid, "the updater leads its own process group");
    assert_ne!(
        pgid,
        pgid_of(std::process::id()),
        "the updater shares the node's process group"
    );
    assert!(
        alive(pid),
        "the updater died with the node side that started it"
    );
}

#[tokio::test]
async fn an_updater_that_exits_is_reaped_and_left_no_zombie() {
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("echo $$ > pid\nprintf 'accepted\\n' >&3\nexit 0"),
        DEFAULT_ACK_WAIT,
    );
    start_upgrade(&up, &spec("1.2.3")).await.expect("accepted");
    let pid = wait_for_file(&dir.path("pid")).await;
    let stat = PathBuf::from(format!("/proc/{pid}"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while stat.exists() {
        assert!(
            Instant::now() < deadline,
            "the updater {pid} was not reaped within 10s (a zombie)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_node_answers_at_the_updaters_first_line_and_its_slot_is_free_right_after() {
    use crate::edge::executor::{Executor, execute_commands};
    use crate::edge::link::{PlaneLink, SessionLink};
    use crate::edge::slot::{Admission, CommandSlot, Queued};
    use crate::journal::MemoryJournal;
    use crate::model::CommandId;
    use crate::model::NodeCommand;
    use crate::node::recovery::Recovery;
    use crate::node::runner::{Runner, RunnerOptions};
    use crate::provider::fake::FakeProvider;
    use tokio_util::sync::CancellationToken;

    let dir = TempDir::new();
    let up = upgrader(
        dir.script("echo $$ > pid\nprintf 'accepted\\n' >&3\nsleep 30"),
        DEFAULT_ACK_WAIT,
    );
    // Spawn the script once first so a busy-text retry cannot skew the timing.
    start_upgrade(&up, &spec("1.2.2")).await.expect("accepted");
    let _first = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));
    std::fs::remove_file(dir.path("pid")).expect("rm pid");

    let link = Arc::new(PlaneLink::new(Duration::from_millis(50)));
    let runner = Arc::new(Runner::new(
        Arc::new(FakeProvider::new()),
        link.clone(),
        link,
        RunnerOptions::default(),
    ));
    let slot = Arc::new(CommandSlot::new());
    let (tx, mut rx) = mpsc::channel(8);
    let session = Arc::new(SessionLink::new(1, tx));
    let far = tokio::time::Instant::now() + Duration::from_secs(86_400);
    for (id, command) in [
        ("a1", NodeCommand::StartUpgrade(spec("1.2.3"))),
        ("a2", NodeCommand::Instances),
    ] {
        let admission = slot.push(Queued {
            id: CommandId::parse("id", id).expect("id"),
            deadline: far,
            command,
            session: session.clone(),
        });
        assert!(matches!(admission, Admission::Queued));
    }
    let cancel = CancellationToken::new();
    let executor = tokio::spawn(execute_commands(
        runner,
        slot,
        Executor {
            recovery: Arc::new(Recovery::done()),
            journal: Arc::new(MemoryJournal::default()),
            ack_timeout: Duration::from_secs(60),
            upgrader: Some(Arc::new(up) as Arc<dyn Upgrader>),
            capacity: Default::default(),
            health: Arc::default(),
        },
        cancel.clone(),
    ));

    let started = Instant::now();
    let mut results = Vec::new();
    while results.len() < 2 {
        let message = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("answered within 10s, long before the updater's 30s are up")
            .expect("session open");
        if let Ok(pb::NodeMessage {
            body: Some(pb::node_message::Body::Result(r)),
        }) = message
        {
            results.push((r, started.elapsed()));
        }
    }
    cancel.cancel();
    executor.await.expect("executor");
    let _second = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));

    let (upgrade, upgrade_at) = &results[0];
    assert_eq!(upgrade.id, "a1");
    assert_eq!(upgrade.outcome, pb::Outcome::Ok as i32, "{upgrade:?}");
    let (next, next_at) = &results[1];
    assert_eq!(next.id, "a2");
    assert_eq!(next.outcome, pb::Outcome::Ok as i32, "{next:?}");
    assert!(*upgrade_at < Duration::from_secs(10), "{upgrade_at:?}");
    assert!(
        next_at.saturating_sub(*upgrade_at) < Duration::from_secs(2),
        "the next command waited {:?} behind the upgrade",
        next_at.saturating_sub(*upgrade_at)
    );
}

#[tokio::test]
async fn a_refusal_reaches_the_plane_as_refused_with_its_sentence() {
    use crate::edge::executor::{Executor, execute_commands};
    use crate::edge::link::{PlaneLink, SessionLink};
    use crate::edge::slot::{CommandSlot, Queued};
    use crate::journal::MemoryJournal;
    use crate::model::CommandId;
    use crate::model::NodeCommand;
    use crate::node::recovery::Recovery;
    use crate::node::runner::{Runner, RunnerOptions};
    use crate::provider::fake::FakeProvider;
    use tokio_util::sync::CancellationToken;

    let dir = TempDir::new();
    let up = upgrader(
        dir.script("printf 'refused: not today\\n' >&3"),
        DEFAULT_ACK_WAIT,
    );
    let link = Arc::new(PlaneLink::new(Duration::from_millis(50)));
    let runner = Arc::new(Runner::new(
        Arc::new(FakeProvider::new()),
        link.clone(),
        link,
        RunnerOptions::default(),
    ));
    let slot = Arc::new(CommandSlot::new());
    let (tx, mut rx) = mpsc::channel(8);
    let session = Arc::new(SessionLink::new(1, tx));
    for (id, upgrader) in [
        ("b1", Some(Arc::new(up) as Arc<dyn Upgrader>)),
        ("b2", None),
    ] {
        let slot = slot.clone();
        slot.push(Queued {
            id: CommandId::parse("id", id).expect("id"),
            deadline: tokio::time::Instant::now() + Duration::from_secs(86_400),
            command: NodeCommand::StartUpgrade(spec("1.2.3")),
            session: session.clone(),
        });
        let cancel = CancellationToken::new();
        let executor = tokio::spawn(execute_commands(
            runner.clone(),
            slot,
            Executor {
                recovery: Arc::new(Recovery::done()),
                journal: Arc::new(MemoryJournal::default()),
                ack_timeout: Duration::from_secs(60),
                upgrader,
                capacity: Default::default(),
                health: Arc::default(),
            },
            cancel.clone(),
        ));
        let r = loop {
            let message = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("answered")
                .expect("session open");
            if let Ok(pb::NodeMessage {
                body: Some(pb::node_message::Body::Result(r)),
            }) = message
            {
                break r;
            }
        };
        cancel.cancel();
        executor.await.expect("executor");
        assert_eq!(r.id, id);
        assert_eq!(r.outcome, pb::Outcome::Refused as i32);
        let error = r.error.expect("an error");
        assert_eq!(error.code, pb::ErrorCode::Refused as i32);
        let expected = if id == "b1" {
            "the updater refused to install 1.2.3: not today"
        } else {
            "this node has no transactional updater, so it cannot install 1.2.3; upgrade it out of band (replace the billet binary and restart the service)"
        };
        assert_eq!(error.message, expected);
    }
}

#[test]
fn the_writer_answers_once_cuts_to_the_limit_and_flattens_newlines() {
    let dir = TempDir::new();
    let path = dir.path("ack");
    let open = || AckWriter {
        out: Some(Channel::Descriptor(File::create(&path).expect("create"))),
    };

    let mut w = open();
    w.refuse("line one\nline two\r\nthree");
    w.accept();
    drop(w);
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        "refused: line one line two  three\n"
    );

    let mut w = open();
    w.refuse(&"é".repeat(4000));
    drop(w);
    let text = std::fs::read_to_string(&path).expect("read");
    assert!(
        text.ends_with('\n') && text.len() <= MAX_ACK_BYTES + 1,
        "{}",
        text.len()
    );
    assert!(text.starts_with(ACK_REFUSED));

    let w = open();
    drop(w);
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        format!("{ACK_REFUSED}{STOPPED_WITHOUT_ANSWER}\n")
    );

    let mut w = AckWriter::none();
    w.accept();
    assert!(!w.is_open());
}

#[tokio::test]
async fn the_reader_stops_at_the_first_newline_without_waiting_for_eof() {
    let (mut tx, mut rx) = tokio::io::duplex(64);
    tokio::io::AsyncWriteExt::write_all(&mut tx, b"accepted\nmore")
        .await
        .expect("write");
    // `tx` stays open: no end of file.
    let answer = tokio::time::timeout(Duration::from_secs(5), read_answer(&mut rx))
        .await
        .expect("no wait for eof")
        .expect("read");
    assert_eq!(answer, Answer::Line(b"accepted".to_vec()));
    drop(tx);
}

#[tokio::test]
async fn an_acceptance_cut_off_by_the_ack_wait_is_not_accepted() {
    // 7.R.17: the whole word, no newline, and then nothing until the
    // wait is over. Not an answer, and not "stopped partway" either:
    // the updater is still there and may still be working.
    let dir = TempDir::new();
    let up = upgrader(
        dir.script("printf 'accepted' >&3\necho $$ > pid\nsleep 20"),
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let r = start_upgrade(&up, &spec("1.2.3")).await;
    let elapsed = started.elapsed();
    let _group = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));
    let (refusal, message) = refusal(r);
    assert_eq!(refusal, Refusal::Silent(Duration::from_secs(1)));
    assert!(message.contains("did not say within 1s"), "{message}");
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(5),
        "returned after {elapsed:?}, not at the 1s bound"
    );
}

/// A stand-in `systemd-run`: records its arguments in `systemd-run.args`,
/// then does what `--no-block` does: starts the command after `--` and
/// returns at once, without waiting for it. Like the real one, the
/// command gets only `PATH` and the variables named by `--setenv=NAME`
/// (values copied from its own environment), and a `--setenv` carrying
/// a value is refused here so no test can pass with one.
const FAKE_SYSTEMD_RUN: &str = include_str!("../../../tests/fixtures/fake-systemd-run.sh");

/// A stand-in `systemd-run` that fails, as a real one does when a unit
/// of the name is still running (its complaint on stderr is left out,
/// to keep the test output quiet).
const FAILING_SYSTEMD_RUN: &str = r#"for a in "$@"; do printf '%s\n' "$a"; done > systemd-run.args
exit 1"#;

/// An updater that only records its arguments in `updater.args`; the
/// test answers for it on the socket it was given.
const RECORDING_UPDATER: &str = r#"for a in "$@"; do printf '%s\n' "$a"; done > updater.args.part
mv updater.args.part updater.args"#;

/// An [`ExecUpgrader`] under systemd: `updater_body` as the updater,
/// `systemd_run_body` as `systemd-run`, the state directory `state`.
fn under_systemd(
    dir: &TempDir,
    systemd_run_body: &str,
    updater_body: &str,
    ack_wait: Duration,
) -> ExecUpgrader {
    // The updater first: by the time the stand-in `systemd-run` (retried
    // on ETXTBSY) has started it, its own write is long closed.
    let binary = dir.script(updater_body);
    let systemd_run = dir.script_named("systemd-run", systemd_run_body);
    let state_dir = dir.path("state");
    std::fs::create_dir_all(&state_dir).expect("state dir");
    ExecUpgrader {
        binary,
        config: None,
        ack_wait,
        dispatch: Dispatch::SystemdRun {
            systemd_run,
            state_dir,
        },
    }
}

fn state_dir(up: &ExecUpgrader) -> &Path {
    let Dispatch::SystemdRun { state_dir, .. } = &up.dispatch else {
        panic!("not under systemd: {up:?}")
    };
    state_dir
}

/// The answer sockets still in `dir`.
fn sockets_left(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .expect("read the state dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with(ACK_SOCKET_PREFIX))
        .collect()
}

/// Waits for the recording updater to have run, and returns its
/// arguments and the socket it was told to answer on.
async fn updater_started(dir: &TempDir) -> (Vec<String>, PathBuf) {
    let args: Vec<String> = wait_for_file(&dir.path("updater.args"))
        .await
        .lines()
        .map(str::to_owned)
        .collect();
    let at = args
        .iter()
        .position(|a| a == "--ack-path")
        .unwrap_or_else(|| panic!("no --ack-path in {args:?}"));
    let socket = PathBuf::from(&args[at + 1]);
    (args, socket)
}

fn fenced_spec() -> UpgradeSpec {
    UpgradeSpec {
        version: "1.2.3".into(),
        manifest_sha256: Some("ab".repeat(32)),
        rollout_id: Some("rollout-7".into()),
        generation: 4,
    }
}

/// Starts the upgrade on a task of its own, so the test can play the
/// updater meanwhile.
fn start_in_background(
    up: &ExecUpgrader,
    spec: UpgradeSpec,
) -> tokio::task::JoinHandle<Result<(), UpgradeError>> {
    let up = up.clone();
    tokio::spawn(async move { start_upgrade(&up, &spec).await })
}

async fn finished(
    task: tokio::task::JoinHandle<Result<(), UpgradeError>>,
) -> Result<(), UpgradeError> {
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("answered within 10s")
        .expect("the upgrade task")
}

#[tokio::test]
async fn under_systemd_the_updater_runs_in_its_own_unit_and_answers_on_a_socket() {
    // 7.R.19.
    let dir = TempDir::new();
    let up = under_systemd(&dir, FAKE_SYSTEMD_RUN, RECORDING_UPDATER, DEFAULT_ACK_WAIT);
    let task = start_in_background(&up, fenced_spec());
    let (updater_args, socket) = updater_started(&dir).await;
    assert!(socket.is_absolute(), "{}", socket.display());
    assert_eq!(socket.parent(), Some(state_dir(&up)));
    let name = socket.file_name().expect("name").to_string_lossy();
    assert!(
        name.starts_with(ACK_SOCKET_PREFIX) && name.len() == ACK_SOCKET_PREFIX.len() + 32,
        "{name}"
    );
    // The updater's end, as `billet host-upgrade --ack-path` writes it.
    AckWriter::connect(&socket).expect("connect").accept();
    finished(task).await.expect("accepted");

    let run_args = std::fs::read_to_string(dir.path("systemd-run.args")).expect("args");
    let run_args: Vec<&str> = run_args.lines().collect();
    let dashes = run_args.iter().position(|a| *a == "--").expect("--");
    let (unit, command) = (&run_args[..dashes], &run_args[dashes + 1..]);
    for a in unit.iter().filter(|a| a.starts_with("--setenv")) {
        assert!(
            a.strip_prefix("--setenv=")
                .is_some_and(|n| UPDATER_ENVIRONMENT.contains(&n)),
            "{a}"
        );
    }
    assert_eq!(
        unit.iter()
            .copied()
            .filter(|a| !a.starts_with("--setenv"))
            .collect::<Vec<_>>(),
        [
            "--unit=billet-host-upgrade-rollout-7-g4",
            "--description=billet updater installing 1.2.3",
            "--service-type=oneshot",
            "--collect",
            "--quiet",
            "--no-block",
            "--property=TimeoutStartSec=88200",
            "--property=TimeoutStopSec=88200",
        ]
    );
    let digest = "ab".repeat(32);
    let socket = socket.to_string_lossy();
    let binary = up.binary.to_string_lossy();
    assert_eq!(
        command,
        [
            &*binary,
            "host-upgrade",
            "--version",
            "1.2.3",
            "--manifest-sha256",
            &digest,
            "--rollout",
            "rollout-7",
            "--generation",
            "4",
            "--ack-path",
            &socket,
        ]
    );
    assert_eq!(updater_args, command[1..], "what the updater was given");
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());
}

#[tokio::test]
async fn under_systemd_the_updaters_refusal_comes_back_over_the_socket() {
    // 7.R.20.
    let dir = TempDir::new();
    let up = under_systemd(&dir, FAKE_SYSTEMD_RUN, RECORDING_UPDATER, DEFAULT_ACK_WAIT);
    let task = start_in_background(&up, spec("1.2.3"));
    let (_, socket) = updater_started(&dir).await;
    AckWriter::connect(&socket)
        .expect("connect")
        .refuse("the manifest digest does not match");
    let (refusal, message) = refusal(finished(task).await);
    assert_eq!(
        refusal,
        Refusal::Said("the manifest digest does not match".into())
    );
    assert_eq!(
        message,
        "the updater refused to install 1.2.3: the manifest digest does not match"
    );
    let run_args = std::fs::read_to_string(dir.path("systemd-run.args")).expect("args");
    assert!(
        run_args
            .lines()
            .any(|a| a == "--unit=billet-host-upgrade-manual-g0"),
        "{run_args}"
    );
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());
}

#[tokio::test]
async fn a_failing_systemd_run_is_reported_at_once_without_waiting_for_an_answer() {
    // 7.R.21: the ack wait is long; the failure must not wait for it.
    let dir = TempDir::new();
    let up = under_systemd(
        &dir,
        FAILING_SYSTEMD_RUN,
        RECORDING_UPDATER,
        Duration::from_secs(60),
    );
    let started = Instant::now();
    let r = start_upgrade(&up, &spec("1.2.3")).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    let Err(e @ UpgradeError::Spawn { .. }) = r else {
        panic!("expected a spawn error, got {r:?}");
    };
    let message = e.to_string();
    assert!(message.contains("/systemd-run failed"), "{message}");
    assert!(message.contains("exit status: 1"), "{message}");
    assert!(dir.path("systemd-run.args").exists(), "it never ran");
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());

    // And one that is not there at all.
    let mut up = up;
    up.dispatch = Dispatch::SystemdRun {
        systemd_run: dir.path("no-such-systemd-run"),
        state_dir: state_dir(&up).to_owned(),
    };
    let started = Instant::now();
    let r = up.start_upgrade(&spec("1.2.3")).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    let Err(e @ UpgradeError::Spawn { .. }) = r else {
        panic!("expected a spawn error, got {r:?}");
    };
    assert!(
        e.to_string().contains("cannot run") && e.to_string().contains("no-such-systemd-run"),
        "{e}"
    );
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());
}

#[tokio::test]
async fn under_systemd_an_updater_that_never_connects_is_refused_at_the_ack_wait() {
    // 7.R.13 as the reference means it: nobody ever connects.
    let dir = TempDir::new();
    let up = under_systemd(
        &dir,
        FAKE_SYSTEMD_RUN,
        RECORDING_UPDATER,
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let r = start_upgrade(&up, &spec("1.2.3")).await;
    let elapsed = started.elapsed();
    let (refusal, message) = refusal(r);
    assert_eq!(refusal, Refusal::Silent(Duration::from_secs(1)));
    assert!(message.contains("did not say within 1s"), "{message}");
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(5),
        "returned after {elapsed:?}, not at the 1s bound"
    );
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());
    // Too late now: the socket is gone, and the updater is told so.
    let (_, socket) = updater_started(&dir).await;
    let e = AckWriter::connect(&socket).expect_err("nobody listens");
    assert!(e.to_string().contains(&*socket.to_string_lossy()), "{e}");
}

#[tokio::test]
async fn under_systemd_an_acceptance_cut_off_by_the_ack_wait_is_not_accepted() {
    // 7.R.17 on the socket: connected, the whole word, no newline, and
    // the connection held open past the wait.
    let dir = TempDir::new();
    let up = under_systemd(
        &dir,
        FAKE_SYSTEMD_RUN,
        RECORDING_UPDATER,
        Duration::from_secs(1),
    );
    let started = Instant::now();
    let task = start_in_background(&up, spec("1.2.3"));
    let (_, socket) = updater_started(&dir).await;
    let mut stream = UnixStream::connect(&socket).expect("connect");
    stream.write_all(b"accepted").expect("write");
    let (refusal, message) = refusal(finished(task).await);
    let elapsed = started.elapsed();
    drop(stream);
    assert_eq!(refusal, Refusal::Silent(Duration::from_secs(1)));
    assert!(message.contains("did not say within 1s"), "{message}");
    assert!(elapsed >= Duration::from_secs(1), "{elapsed:?}");
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());
}

#[tokio::test]
async fn under_systemd_an_updater_that_hangs_up_without_a_word_is_refused_as_such() {
    let dir = TempDir::new();
    let up = under_systemd(&dir, FAKE_SYSTEMD_RUN, RECORDING_UPDATER, DEFAULT_ACK_WAIT);
    let task = start_in_background(&up, spec("1.2.3"));
    let (_, socket) = updater_started(&dir).await;
    drop(UnixStream::connect(&socket).expect("connect"));
    let (refusal, _) = refusal(finished(task).await);
    assert_eq!(refusal, Refusal::WithoutWord);
    assert_eq!(sockets_left(state_dir(&up)), Vec::<String>::new());
}

#[tokio::test]
async fn a_state_directory_too_long_for_the_answer_socket_is_refused_before_anything_runs() {
    let dir = TempDir::new();
    let mut up = under_systemd(&dir, FAKE_SYSTEMD_RUN, RECORDING_UPDATER, DEFAULT_ACK_WAIT);
    let long = dir.path(&"s".repeat(MAX_SOCKET_PATH_BYTES));
    std::fs::create_dir_all(&long).expect("long state dir");
    up.dispatch = Dispatch::SystemdRun {
        systemd_run: dir.path("systemd-run"),
        state_dir: long.clone(),
    };
    let started = Instant::now();
    let r = start_upgrade(&up, &spec("1.2.3")).await;
    assert!(started.elapsed() < Duration::from_secs(5));
    let Err(e @ UpgradeError::Spawn { .. }) = r else {
        panic!("expected a spawn error, got {r:?}");
    };
    let message = e.to_string();
    assert!(
        message.contains(&format!(
            "a unix socket's path is at most {MAX_SOCKET_PATH_BYTES} bytes"
        )),
        "{message}"
    );
    assert!(
        message.contains("give the node a state directory"),
        "{message}"
    );
    assert!(
        !dir.path("systemd-run.args").exists(),
        "systemd-run was started anyway"
    );
    assert_eq!(sockets_left(&long), Vec::<String>::new());
}

#[test]
fn under_systemd_the_updaters_unit_settles_whatever_it_leaves_when_it_ends() {
    let mut up = ExecUpgrader::new("/opt/billet 50%/billet");
    let args = |up: &ExecUpgrader| -> Vec<String> {
        up.systemd_run_args(&spec("1.2.3"), Path::new("/s/upgrade-ack-x"), |_| false)
            .expect("args")
            .into_iter()
            .map(|a| a.into_string().expect("utf-8"))
            .collect()
    };
    assert!(
        !args(&up).iter().any(|a| a.contains("ExecStopPost")),
        "without a configuration there is nothing to settle with"
    );
    up.config = Some("/etc/billet/up grade.toml".into());
    let args = args(&up);
    let dashes = args.iter().position(|a| a == "--").expect("--");
    let post: Vec<&String> = args[..dashes]
        .iter()
        .filter(|a| a.starts_with("--property=ExecStopPost="))
        .collect();
    assert_eq!(
        post,
        [
            r#"--property=ExecStopPost="/opt/billet 50%%/billet" host-upgrade --settle --config "/etc/billet/up grade.toml""#
        ],
        "quoted words, systemd specifiers escaped"
    );
}

#[test]
fn under_systemd_the_environment_goes_by_name_and_never_by_value() {
    // 7.R.23, the command line; agent/tests/upgrade.rs runs it with a
    // real environment.
    let up = ExecUpgrader::new("/usr/local/bin/billet");
    let present = [
        "BILLET_LOG",
        "HTTPS_PROXY",
        "DATABASE_URL",
        "AWS_SECRET_ACCESS_KEY",
    ];
    let args = up
        .systemd_run_args(
            &spec("1.2.3"),
            Path::new("/var/lib/billet/upgrade-ack-x"),
            |name| present.contains(&name),
        )
        .expect("args");
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.into_string().expect("utf-8"))
        .collect();
    let dashes = args.iter().position(|a| a == "--").expect("--");
    let setenv: Vec<&str> = args
        .iter()
        .filter_map(|a| a.strip_prefix("--setenv="))
        .collect();
    assert_eq!(setenv, ["BILLET_LOG", "HTTPS_PROXY"], "{args:?}");
    assert!(
        args[..dashes]
            .iter()
            .filter(|a| a.starts_with("--setenv="))
            .count()
            == 2,
        "every --setenv is systemd-run's, before --"
    );
    assert!(
        !args
            .iter()
            .any(|a| a.contains("DATABASE_URL") || a.contains("AWS_")),
        "a variable off the allow-list: {args:?}"
    );
}

#[test]
fn unit_names_follow_the_rollout_and_generation_and_escape_what_systemd_does_not_allow() {
    let name = |rollout: Option<&str>, generation| {
        unit_name(&UpgradeSpec {
            version: "1.2.3".into(),
            manifest_sha256: None,
            rollout_id: rollout.map(str::to_owned),
            generation,
        })
    };
    assert_eq!(
        name(Some("rollout-7"), 4).expect("name"),
        "billet-host-upgrade-rollout-7-g4"
    );
    assert_eq!(
        name(Some("r_1.2:x"), 12).expect("name"),
        "billet-host-upgrade-r_1.2:x-g12"
    );
    assert_eq!(
        name(None, 0).expect("name"),
        "billet-host-upgrade-manual-g0"
    );
    assert_eq!(
        name(Some(""), 3).expect("name"),
        "billet-host-upgrade-manual-g3"
    );
    assert_eq!(
        name(Some("a/b c\\é"), 1).expect("name"),
        "billet-host-upgrade-a\\x2fb\\x20c\\x5c\\xc3\\xa9-g1"
    );
    assert!(
        name(Some(&"r".repeat(crate::model::MAX_ID_LEN)), u64::MAX).is_ok(),
        "the longest rollout id the wire allows names a unit"
    );
    assert!(matches!(
        name(Some(&"r".repeat(300)), 1),
        Err(UpgradeError::Spec {
            field: "rollout_id",
            ..
        })
    ));
}

#[test]
fn a_node_under_systemd_starts_its_updater_through_systemd_run_and_any_other_directly() {
    let state = PathBuf::from("/var/lib/billet");
    let under_systemd = Dispatch::for_invocation(Some("0123abcd".into()), state.clone());
    if cfg!(target_os = "linux") {
        assert_eq!(
            under_systemd,
            Dispatch::SystemdRun {
                systemd_run: SYSTEMD_RUN.into(),
                state_dir: state.clone(),
            }
        );
    } else {
        assert_eq!(under_systemd, Dispatch::Detached);
    }
    assert_eq!(
        Dispatch::for_invocation(None, state.clone()),
        Dispatch::Detached
    );
    assert_eq!(
        Dispatch::for_invocation(Some("".into()), state),
        Dispatch::Detached
    );
    assert_eq!(
        ExecUpgrader::new("/usr/local/bin/billet").dispatch,
        Dispatch::Detached
    );
}

#[test]
fn the_writer_answers_over_the_nodes_socket_once_and_hangs_up() {
    use std::io::Read;

    let dir = TempDir::new();
    let path = dir.path("ack.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    let heard = || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut text = String::new();
        // To end of file: the writer hangs up after its one answer.
        stream.read_to_string(&mut text).expect("read");
        text
    };

    let mut w = AckWriter::connect(&path).expect("connect");
    assert!(w.is_open());
    w.refuse("line one\nline two");
    w.accept();
    assert!(!w.is_open());
    assert_eq!(heard(), "refused: line one line two\n");
    drop(w);

    let w = AckWriter::connect(&path).expect("connect");
    drop(w);
    assert_eq!(heard(), format!("{ACK_REFUSED}{STOPPED_WITHOUT_ANSWER}\n"));

    let missing = dir.path("gone.sock");
    let e = AckWriter::connect(&missing).expect_err("nothing listens");
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}");
}
