use std::time::Duration;

use super::*;
use crate::model::{ByteSize, Epoch, JitConfig, LeaseId, NodeName, RequestId};

const SOCKET: &str = "/var/run/docker.sock";
const TEST_IMAGE_REPO: &str = "billet-test-shell";
const TEST_IMAGE_TAG: &str = "job";
const TEST_IMAGE: &str = "billet-test-shell:job";

fn owner(deployment: &str, node: &str) -> Owner {
    Owner {
        deployment: deployment.to_owned(),
        node: NodeName::parse("node", node).unwrap(),
    }
}

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

fn spec(lease: &str, jit: &str) -> InstanceSpec {
    let lease = LeaseId::parse("lease", lease).unwrap();
    InstanceSpec {
        name: InstanceName::for_lease(&lease),
        lease,
        epoch: Epoch(7),
        request_id: RequestId(1234),
        image: TEST_IMAGE.to_owned(),
        command: vec!["/bin/sleep".to_owned(), "300".to_owned()],
        vcpu: 1,
        memory: ByteSize(64 << 20),
        shm: ByteSize(16 << 20),
        network: Some("none".to_owned()),
        env: vec![("RUNNER_TIER".to_owned(), "small".to_owned())],
        jit_config: JitConfig::new(jit.to_owned()),
        binds: Vec::new(),
        cache_token: None,
        actions_proxy: None,
        host: Default::default(),
        pids_limit: None,
    }
}

fn offline() -> DockerProvider {
    DockerProvider::connect(
        Path::new("/nonexistent/docker.sock"),
        owner("dep", "node-a"),
    )
    .unwrap()
    .without_handoff_wait()
}

// ---- pure helpers -------------------------------------------------

#[test]
fn the_version_segment_is_stripped_for_the_unversioned_probe() {
    assert_eq!(
        strip_version_segment("unix://2f7661722f72756e/v1.53/version").as_deref(),
        Some("unix://2f7661722f72756e/version")
    );
    assert_eq!(
        strip_version_segment("unix://h/v1.41/containers/json?all=true").as_deref(),
        Some("unix://h/containers/json?all=true")
    );
    assert_eq!(strip_version_segment("unix://h/version"), None);
    assert_eq!(strip_version_segment("unix://h/volumes"), None);
}

#[test]
fn the_api_version_is_the_lower_of_the_engines_and_bollards_and_never_below_1_41() {
    let v = |text| parse_api_version(text).unwrap();
    assert_eq!(choose_api_version(v("1.41")), Some(v("1.41")));
    assert_eq!(choose_api_version(v("1.47")), Some(v("1.47")));
    assert_eq!(choose_api_version(v("1.99")), Some(*API_DEFAULT_VERSION));
    assert_eq!(choose_api_version(v("1.40")), None);
    assert!(parse_api_version("1").is_none());
    assert!(parse_api_version("one.two").is_none());
}

fn summary(
    id: Option<&str>,
    names: &[&str],
    state: Option<ContainerSummaryStateEnum>,
) -> ContainerSummary {
    ContainerSummary {
        id: id.map(str::to_owned),
        names: Some(names.iter().map(|n| (*n).to_owned()).collect()),
        state,
        labels: Some(HashMap::from([
            (labels::LEASE.to_owned(), "a".to_owned()),
            ("com.example.other".to_owned(), "x".to_owned()),
        ])),
        ..Default::default()
    }
}

#[test]
fn each_listed_state_maps_to_what_the_engine_says_and_an_unknown_one_may_run() {
    use ContainerSummaryStateEnum as S;
    for (state, expected) in [
        (None, InstanceState::Unknown),
        (Some(S::EMPTY), InstanceState::Unknown),
        (Some(S::CREATED), InstanceState::Created),
        (Some(S::RUNNING), InstanceState::Running),
        (Some(S::PAUSED), InstanceState::Running),
        (Some(S::RESTARTING), InstanceState::Running),
        // Read further by an inspect in `inventory`.
        (Some(S::EXITED), InstanceState::Unknown),
        (Some(S::REMOVING), InstanceState::Removing),
        (Some(S::DEAD), InstanceState::Removing),
        (Some(S::STOPPING), InstanceState::Running),
    ] {
        let instance = instance_from_summary(summary(Some("abc"), &["/billet-a"], state)).unwrap();
        assert_eq!(instance.state, expected, "{state:?}");
        assert_eq!(instance.name, "billet-a");
        assert_eq!(
            instance.labels,
            BTreeMap::from([(labels::LEASE.to_owned(), "a".to_owned())])
        );
    }
}

#[test]
fn an_entry_without_an_id_or_a_name_is_malformed() {
    assert!(instance_from_summary(summary(None, &["/billet-a"], None)).is_err());
    assert!(instance_from_summary(summary(Some(""), &["/billet-a"], None)).is_err());
    assert!(instance_from_summary(summary(Some("abc"), &[], None)).is_err());
    assert!(instance_from_summary(summary(Some("abc"), &["/"], None)).is_err());
    // A legacy link alias is not the container's own name.
    let linked =
        instance_from_summary(summary(Some("abc"), &["/web/db", "/billet-a"], None)).unwrap();
    assert_eq!(linked.name, "billet-a");
}

/// A stand-in engine on a Unix socket: `/version` answers API 1.43 and
/// `/containers/json` answers `containers` (raw JSON), one request per
/// connection; anything else is a 404.
fn engine_listing(containers: &'static str) -> std::path::PathBuf {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let path = std::env::temp_dir().join(unique("billet-listing-engine"));
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0_u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let line = String::from_utf8_lossy(&head);
                let target = line.split_whitespace().nth(1).unwrap_or_default();
                let (status, body) = if target.ends_with("/version") {
                    ("200 OK", r#"{"ApiVersion":"1.43","Version":"24.0.0"}"#)
                } else if target.contains("/containers/json") {
                    ("200 OK", containers)
                } else {
                    ("404 Not Found", r#"{"message":"no such endpoint"}"#)
                };
                let reply = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(reply.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    path
}

#[tokio::test]
async fn list_fails_on_a_malformed_entry_rather_than_answering_a_partial_inventory() {
    let labels =
        r#"{"sh.billet.deployment":"dep","sh.billet.node":"node-1","sh.billet.lease":"a"}"#;
    let good =
        format!(r#"{{"Id":"c1","Names":["/billet-a"],"State":"running","Labels":{labels}}}"#);
    let owner = owner("dep", "node-1");

    // The engine answers: a well-formed inventory lists.
    let listing: &'static str = Box::leak(format!("[{good}]").into_boxed_str());
    let provider = DockerProvider::connect(&engine_listing(listing), owner.clone())
        .unwrap()
        .without_handoff_wait()
        .with_timeout(Duration::from_secs(10));
    let listed = provider
        .list()
        .await
        .expect("a well-formed inventory lists");
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].name, "billet-a");

    // The same inventory with an entry that has no name, or no id.
    for bad in [
        r#"{"Id":"c2","Names":[],"State":"running","Labels":{}}"#,
        r#"{"Names":["/billet-b"],"State":"running","Labels":{}}"#,
    ] {
        let listing: &'static str = Box::leak(format!("[{good},{bad}]").into_boxed_str());
        let provider = DockerProvider::connect(&engine_listing(listing), owner.clone())
            .unwrap()
            .without_handoff_wait()
            .with_timeout(Duration::from_secs(10));
        match provider.list().await {
            Err(ProviderError::Engine { operation, .. }) => {
                assert!(operation.contains("list"), "{operation}")
            }
            other => panic!("a malformed entry {bad} gave {other:?}, not a list failure"),
        }
    }
}

#[test]
fn a_jit_config_is_scrubbed_from_engine_messages() {
    assert_eq!(
        redact("bad value c2VjcmV0 here".to_owned(), "c2VjcmV0"),
        "bad value <redacted> here"
    );
    assert_eq!(
        redact(
            format!("invalid env {JIT_CONFIG_ENV}=c2Vj..., more"),
            "c2VjcmV0"
        ),
        format!("invalid env {JIT_CONFIG_ENV}=<redacted>")
    );
    assert_eq!(redact("plain".to_owned(), ""), "plain");
}

#[test]
fn only_a_not_found_answer_counts_as_already_gone() {
    let answer = |status_code, message: &str| BollardError::DockerResponseServerError {
        status_code,
        message: message.to_owned(),
    };
    assert!(is_no_such_container(&answer(404, "page not found")));
    assert!(is_no_such_container(&answer(
        500,
        "Error: No such container: billet-a"
    )));
    assert!(!is_no_such_container(&answer(
        409,
        "removal of container billet-a is already in progress"
    )));
    assert!(!is_no_such_container(&BollardError::RequestTimeoutError));
}

#[test]
fn registry_mirrors_reach_a_container_as_a_read_only_daemon_json_and_an_env_and_none_as_neither() {
    let plain = offline();
    let (_, body, _) = plain.container_for(&spec("lease-1", "c2VjcmV0")).unwrap();
    let env = body.env.unwrap();
    assert!(
        !env.iter()
            .any(|e| e.starts_with(super::super::mirrors::MIRRORS_ENV)),
        "{env:?}"
    );
    let mounts = body.host_config.unwrap().mounts.unwrap();
    assert!(
        mounts
            .iter()
            .all(|m| m.target.as_deref() == Some(GUEST_DIR)),
        "{mounts:?}"
    );

    let dir = std::env::temp_dir().join(unique("billet-mirrors-provider"));
    std::fs::create_dir_all(&dir).unwrap();
    let urls = vec![
        "https://m1.example".to_owned(),
        "http://m2.example:5000".to_owned(),
    ];
    let mirrors = super::super::mirrors::GuestMirrors::prepare(&dir, urls).unwrap();
    let daemon_json = mirrors.daemon_json().unwrap().to_owned();
    let provider = offline().with_registry_mirrors(mirrors);
    let mut with_own = spec("lease-1", "c2VjcmV0");
    with_own.env.push((
        super::super::mirrors::MIRRORS_ENV.to_owned(),
        "https://the-tier.example".to_owned(),
    ));
    let (_, body, _) = provider.container_for(&with_own).unwrap();
    let env = body.env.unwrap();
    let given: Vec<&String> = env
        .iter()
        .filter(|e| e.starts_with(super::super::mirrors::MIRRORS_ENV))
        .collect();
    assert_eq!(
        given,
        ["BILLET_REGISTRY_MIRRORS=https://m1.example,http://m2.example:5000"]
    );
    let mounts = body.host_config.unwrap().mounts.unwrap();
    assert_eq!(mounts.len(), 2, "{mounts:?}");
    assert_eq!(mounts[0].target.as_deref(), Some("/etc/docker/daemon.json"));
    assert_eq!(
        mounts[0].source.as_deref(),
        Some(daemon_json.to_str().unwrap())
    );
    assert_eq!(mounts[0].read_only, Some(true));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_create_request_carries_no_credential_only_where_to_read_them() {
    let provider = offline();
    let (name, body, secrets) = provider
        .container_for(&spec("lease-1", "c2VjcmV0"))
        .unwrap();
    assert_eq!(name, "billet-lease-1");
    let env = body.env.clone().unwrap();
    assert_eq!(
        env,
        [
            "RUNNER_TIER=small",
            &format!("{SECRETS_ENV}={GUEST_DIR}/{SECRETS_FILE}")
        ]
    );
    assert_eq!(
        format!("{secrets:?}"),
        format!("Secrets {{ keys: [{JIT_CONFIG_ENV:?}] }}")
    );
    let mounts = body.host_config.clone().unwrap().mounts.unwrap();
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(mounts[0].target.as_deref(), Some(GUEST_DIR));
    assert_eq!(mounts[0].read_only, Some(true));
    assert_eq!(body.entrypoint.clone().unwrap(), ["/bin/sleep"]);
    assert_eq!(body.cmd.clone().unwrap(), ["300"]);
    let host = body.host_config.clone().unwrap();
    assert_eq!(host.nano_cpus, Some(1_000_000_000));
    assert_eq!(host.memory, Some(64 << 20));
    assert_eq!(host.shm_size, Some(16 << 20));
    assert_eq!(host.network_mode.as_deref(), Some("none"));
    let labels = body.labels.clone().unwrap();
    assert_eq!(labels[labels::DEPLOYMENT], "dep");
    assert_eq!(labels[labels::NODE], "node-a");
    assert_eq!(labels[labels::LEASE], "lease-1");
    assert_eq!(labels[labels::EPOCH], "7");
    assert_eq!(labels[labels::REQUEST], "1234");
    // Nothing the engine records holds the secret.
    assert!(!serde_json::to_string(&body).unwrap().contains("c2VjcmV0"));

    let mut unlimited = spec("lease-1", "j");
    unlimited.vcpu = 0;
    unlimited.memory = ByteSize(0);
    unlimited.shm = ByteSize(0);
    unlimited.network = None;
    let host = provider
        .container_for(&unlimited)
        .unwrap()
        .1
        .host_config
        .unwrap();
    assert_eq!(
        (
            host.nano_cpus,
            host.memory,
            host.shm_size,
            host.network_mode
        ),
        (None, None, None, None)
    );
}

#[tokio::test]
async fn create_refuses_a_bad_spec_before_reaching_the_engine() {
    let provider = offline();
    let mut cases = Vec::new();
    let mut wrong_name = spec("a", "j");
    wrong_name.name = InstanceName::for_lease(&LeaseId::parse("l", "b").unwrap());
    cases.push(wrong_name);
    let mut no_command = spec("a", "j");
    no_command.command.clear();
    cases.push(no_command);
    cases.push(spec("a", ""));
    let mut jit_in_env = spec("a", "j");
    jit_in_env
        .env
        .push((JIT_CONFIG_ENV.to_owned(), "other".to_owned()));
    cases.push(jit_in_env);
    let mut bad_key = spec("a", "j");
    bad_key.env.push(("A=B".to_owned(), "c".to_owned()));
    cases.push(bad_key);
    let mut huge = spec("a", "j");
    huge.memory = ByteSize(u64::MAX);
    cases.push(huge);
    for case in cases {
        let err = provider.create(case).await.unwrap_err();
        assert!(matches!(err, ProviderError::Refused(_)), "{err}");
    }
    // The engine was never contacted.
    assert!(provider.api_version().is_none());
}

/// 7.Q.6: a spec without a registration (an empty or blank JIT config)
/// is refused before the engine is contacted, and the refusal says so.
#[tokio::test]
async fn create_refuses_a_spec_with_no_registration_before_reaching_the_engine() {
    let provider = offline();
    for blank in ["", " ", "\n\t "] {
        let err = provider.create(spec("a", blank)).await.unwrap_err();
        match &err {
            ProviderError::Refused(why) => {
                assert!(why.contains("JIT config is empty"), "{blank:?}: {why}");
            }
            other => panic!("{blank:?} was not refused: {other}"),
        }
    }
    assert!(
        provider.api_version().is_none(),
        "the engine was contacted for a spec with no registration"
    );
}

// ---- without an engine ----------------------------------------------

#[tokio::test]
async fn ping_names_a_socket_that_cannot_be_reached() {
    let missing = Path::new("/nonexistent/billet-test.sock");
    let provider = DockerProvider::connect(missing, owner("dep", "node-a"))
        .unwrap()
        .without_handoff_wait();
    let err = provider.ping().await.unwrap_err().to_string();
    assert!(err.contains("/nonexistent/billet-test.sock"), "{err}");
    assert!(err.contains("cannot be reached"), "{err}");

    // A path that exists but where nothing listens.
    let not_a_socket = std::env::temp_dir().join(unique("billet-not-a-socket"));
    std::fs::write(&not_a_socket, b"").unwrap();
    let provider = DockerProvider::connect(&not_a_socket, owner("dep", "node-a"))
        .unwrap()
        .without_handoff_wait();
    let err = provider.ping().await.unwrap_err().to_string();
    let _ = std::fs::remove_file(&not_a_socket);
    assert!(err.contains(&not_a_socket.display().to_string()), "{err}");
    assert!(err.contains("cannot be reached"), "{err}");
}

/// The tests that need the Docker engine at [`SOCKET`]: the fast loop
/// (`scripts/fast`, the `fast` profile in `.config/nextest.toml`) leaves
/// out every test in a module named `needs_docker`, so a test that
/// talks to the engine belongs here and nowhere else.
mod needs_docker {
    use std::process::Command;

    use bollard::query_parameters::CreateImageOptions;
    use futures::TryStreamExt as _;

    use super::*;
    use crate::provider::contract;

    // ---- against the real engine ----------------------------------

    /// Removes the named containers, whatever their labels, when dropped,
    /// even when the test panicked.
    struct Leftovers(Vec<String>);

    impl Drop for Leftovers {
        fn drop(&mut self) {
            let names = std::mem::take(&mut self.0);
            // Drop cannot await, and a runtime cannot start inside the
            // test's own, so remove from a thread with a runtime of its own.
            let cleanup = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for cleanup");
                runtime.block_on(async {
                    let provider =
                        DockerProvider::connect(Path::new(SOCKET), owner("cleanup", "cleanup"))
                            .unwrap()
                            .without_handoff_wait();
                    let Ok(docker) = provider.client("clean up").await else {
                        return;
                    };
                    for name in names {
                        let options = RemoveContainerOptions {
                            force: true,
                            v: true,
                            ..Default::default()
                        };
                        if let Err(err) = docker.remove_container(&name, Some(options)).await
                            && !is_no_such_container(&err)
                        {
                            eprintln!("could not remove test container {name}: {err}");
                        }
                    }
                });
            });
            let _ = cleanup.join();
        }
    }

    /// A provider on the real engine, with the test image present.
    ///
    /// Panics (failing the test) when the engine cannot be reached.
    async fn provider(owner: Owner) -> DockerProvider {
        let provider = DockerProvider::connect(Path::new(SOCKET), owner)
            .unwrap()
            .without_handoff_wait();
        if let Err(err) = provider.ping().await {
            panic!("these tests need the Docker engine at {SOCKET}, and it cannot be used: {err}");
        }
        ensure_test_image(provider.client("test").await.unwrap()).await;
        provider
    }

    static TEST_IMAGE_READY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

    /// Imports `billet-test-shell:job` (the host's `sleep` and `sh`, `sleep`
    /// again as the runner's job process, and the shared libraries they
    /// need, nothing else) unless the engine has it:
    /// no registry can be reached from here.
    async fn ensure_test_image(docker: &Docker) {
        TEST_IMAGE_READY
            .get_or_init(|| async {
                if docker.inspect_image(TEST_IMAGE).await.is_ok() {
                    return;
                }
                let tar = tokio::task::spawn_blocking(test_rootfs_tar).await.unwrap();
                let options = CreateImageOptions {
                    from_src: Some("-".to_owned()),
                    repo: Some(TEST_IMAGE_REPO.to_owned()),
                    tag: Some(TEST_IMAGE_TAG.to_owned()),
                    ..Default::default()
                };
                docker
                    .create_image(Some(options), Some(bollard::body_full(tar.into())), None)
                    .try_collect::<Vec<_>>()
                    .await
                    .unwrap_or_else(|err| panic!("importing {TEST_IMAGE} failed: {err}"));
                docker
                    .inspect_image(TEST_IMAGE)
                    .await
                    .unwrap_or_else(|err| panic!("{TEST_IMAGE} is missing after import: {err}"));
            })
            .await;
    }

    /// A tar of a root file system holding `/bin/sleep`, `/bin/sh` and the
    /// libraries `ldd` says they load, at their host paths.
    fn test_rootfs_tar() -> Vec<u8> {
        let root = std::env::temp_dir().join(unique("billet-test-rootfs"));
        let copy = |from: &Path, to: &Path| {
            let target = root.join(to.strip_prefix("/").unwrap());
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::copy(from, &target).unwrap_or_else(|err| {
                panic!("copying {} into the test image: {err}", from.display())
            });
        };
        for tool in ["sleep", "sh"] {
            let found = [format!("/bin/{tool}"), format!("/usr/bin/{tool}")]
                .into_iter()
                .map(PathBuf::from)
                .find(|path| path.exists())
                .unwrap_or_else(|| {
                    panic!("building the test image needs {tool} at /bin or /usr/bin")
                });
            copy(&found, &Path::new("/bin").join(tool));
            if tool == "sleep" {
                copy(
                    &found,
                    &Path::new("/bin").join(crate::provider::JOB_PROCESS),
                );
            }
            let ldd = Command::new("ldd")
                .arg(&found)
                .output()
                .expect("building the test image needs ldd to find the tools' libraries");
            // A static binary makes ldd fail with "not a dynamic executable";
            // then there is nothing to copy.
            for line in String::from_utf8_lossy(&ldd.stdout).lines() {
                if let Some(library) = line.split_whitespace().find(|word| word.starts_with('/')) {
                    copy(Path::new(library), Path::new(library));
                }
            }
        }
        let tar = Command::new("tar")
            .arg("-C")
            .arg(&root)
            .args(["-cf", "-", "."])
            .output()
            .expect("building the test image needs tar");
        let _ = std::fs::remove_dir_all(&root);
        assert!(
            tar.status.success(),
            "tar failed: {}",
            String::from_utf8_lossy(&tar.stderr)
        );
        tar.stdout
    }

    async fn inspect(
        provider: &DockerProvider,
        name: &str,
    ) -> bollard::models::ContainerInspectResponse {
        provider
            .client("inspect")
            .await
            .unwrap()
            .inspect_container(name, None)
            .await
            .unwrap_or_else(|err| panic!("inspect {name}: {err}"))
    }

    /// A Unix socket in front of the engine's that counts the connections
    /// made to it and forwards each to the engine.
    async fn counting_proxy() -> (PathBuf, Arc<std::sync::atomic::AtomicUsize>) {
        let dir = std::env::temp_dir().join(unique("billet-engine-count"));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("docker.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut engine = tokio::net::UnixStream::connect(SOCKET)
                        .await
                        .unwrap_or_else(|e| {
                            panic!("these tests need the Docker engine at {SOCKET}: {e}")
                        });
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut engine).await;
                });
            }
        });
        (path, accepted)
    }

    #[tokio::test]
    async fn consecutive_calls_reuse_one_connection_to_the_engine() {
        let (socket, accepted) = counting_proxy().await;
        let provider = DockerProvider::connect(&socket, owner(&unique("dep"), "node-a")).unwrap();
        provider
            .ping()
            .await
            .expect("the engine answers through the proxy");
        provider.list().await.expect("list");
        let after_first = accepted.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..10 {
            provider.list().await.expect("list");
            provider.ping().await.expect("ping");
        }
        let after = accepted.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            after,
            after_first,
            "20 more calls opened {} more connections to the engine",
            after - after_first
        );
    }

    #[tokio::test]
    async fn the_engine_here_is_reached_at_a_version_it_speaks() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let version = provider.api_version().expect("negotiated by ping");
        assert!(version >= MIN_API_VERSION, "{version}");
        assert!(version <= *API_DEFAULT_VERSION, "{version}");
    }

    #[tokio::test]
    async fn a_created_container_is_labelled_and_the_engine_records_no_jit_config() {
        let deployment = unique("dep");
        let provider = provider(owner(&deployment, "node-a")).await;
        let lease = unique("t");
        let jit = unique("jit-secret");
        let spec = spec(&lease, &jit);
        let name = spec.name.clone();
        let _leftovers = Leftovers(vec![name.to_string()]);

        let created = provider.create(spec).await.unwrap();
        assert_eq!(created.name, name.as_str());
        assert_eq!(created.state, InstanceState::Running);
        assert!(!created.id.is_empty());

        let listed = provider.list().await.unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");
        let instance = &listed[0];
        assert_eq!(instance.id, created.id);
        assert_eq!(instance.name, name.as_str());
        assert_eq!(instance.state, InstanceState::Running);
        assert_eq!(instance.lease().unwrap().as_str(), lease);
        assert_eq!(
            instance.labels,
            BTreeMap::from([
                (labels::DEPLOYMENT.to_owned(), deployment.clone()),
                (labels::NODE.to_owned(), "node-a".to_owned()),
                (labels::LEASE.to_owned(), lease.clone()),
                (labels::EPOCH.to_owned(), "7".to_owned()),
                (labels::REQUEST.to_owned(), "1234".to_owned()),
            ])
        );
        assert_eq!(instance.labels, created.labels);

        let inspected = inspect(&provider, name.as_str()).await;
        let recorded = serde_json::to_string(&inspected).unwrap();
        assert!(!recorded.contains(&jit), "{recorded}");
        let config = inspected.config.unwrap();
        let env = config.env.unwrap();
        assert!(
            !env.iter().any(|e| e.starts_with(JIT_CONFIG_ENV)),
            "{env:?}"
        );
        assert!(env.contains(&"RUNNER_TIER=small".to_owned()), "{env:?}");
        assert_eq!(config.entrypoint.unwrap(), ["/bin/sleep"]);
        assert_eq!(config.cmd.unwrap(), ["300"]);
        let host = inspected.host_config.unwrap();
        assert_eq!(host.nano_cpus, Some(1_000_000_000));
        assert_eq!(host.memory, Some(64 << 20));
        assert_eq!(host.shm_size, Some(16 << 20));
        assert_eq!(host.network_mode.as_deref(), Some("none"));
    }

    /// The guest reads its JIT config once from the file its
    /// environment names; a second look finds no file.
    #[tokio::test]
    async fn a_guest_reads_its_jit_config_once_and_then_finds_no_file() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let mut spec = spec(&unique("t"), &unique("jit-secret"));
        spec.command = vec![
            "/bin/sh".into(),
            "-c".into(),
            format!(
                "read -r first < \"${SECRETS_ENV}\"; sleep 1; \
                 [ -e \"${SECRETS_ENV}\" ] && exit 9; \
                 case \"$first\" in {JIT_CONFIG_ENV}=jit-secret-*) exit 0;; esac; exit 8"
            ),
        ];
        let name = spec.name.clone();
        let _leftovers = Leftovers(vec![name.to_string()]);
        provider.create(spec).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let exit = loop {
            let found = provider.find(&name).await.unwrap().expect("present");
            if let InstanceState::Exited(exit) = found.state {
                break exit;
            }
            assert!(tokio::time::Instant::now() < deadline, "{found:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(exit.code, 0, "8: not the JIT config; 9: read twice");
        provider.destroy(&name).await.unwrap();
    }

    #[tokio::test]
    async fn find_matches_the_exact_name_and_not_a_prefix_of_another() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let lease = unique("t");
        let longer = format!("{lease}-long");
        let spec = spec(&longer, &unique("jit"));
        let _leftovers = Leftovers(vec![spec.name.to_string()]);
        let created = provider.create(spec.clone()).await.unwrap();

        let found = provider
            .find(&spec.name)
            .await
            .unwrap()
            .expect("found by exact name");
        assert_eq!(found.id, created.id);
        let prefix = InstanceName::for_lease(&LeaseId::parse("l", &lease).unwrap());
        assert_eq!(provider.find(&prefix).await.unwrap(), None);
        // Destroying the prefix must not remove the longer name's container.
        assert_eq!(provider.destroy(&prefix).await.unwrap(), Teardown::Stopped);
        assert!(provider.find(&spec.name).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn destroying_twice_answers_stopped_both_times_and_the_container_is_gone() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let spec = spec(&unique("t"), &unique("jit"));
        let _leftovers = Leftovers(vec![spec.name.to_string()]);
        let created = provider.create(spec.clone()).await.unwrap();

        assert_eq!(
            provider.destroy(&spec.name).await.unwrap(),
            Teardown::Stopped
        );
        assert_eq!(
            provider.destroy(&spec.name).await.unwrap(),
            Teardown::Stopped
        );
        assert_eq!(provider.find(&spec.name).await.unwrap(), None);
        assert!(provider.list().await.unwrap().is_empty());
        let docker = provider.client("test").await.unwrap();
        let err = docker
            .inspect_container(&created.id, None)
            .await
            .unwrap_err();
        assert!(is_no_such_container(&err), "{err}");
    }

    #[tokio::test]
    async fn another_nodes_or_deployments_containers_are_never_seen_or_removed() {
        let deployment = unique("dep");
        let here = provider(owner(&deployment, "node-a")).await;
        let other_node = provider(owner(&deployment, "node-b")).await;
        let other_deployment = provider(owner(&unique("dep"), "node-a")).await;
        let theirs = spec(&unique("t"), &unique("jit"));
        let ours = spec(&unique("t"), &unique("jit"));
        let _leftovers = Leftovers(vec![theirs.name.to_string(), ours.name.to_string()]);
        other_node.create(theirs.clone()).await.unwrap();
        here.create(ours.clone()).await.unwrap();

        let names: Vec<_> = here
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(names, [ours.name.to_string()]);
        assert_eq!(here.find(&theirs.name).await.unwrap(), None);
        assert!(other_deployment.list().await.unwrap().is_empty());
        assert_eq!(other_deployment.find(&ours.name).await.unwrap(), None);

        // Not ours reads as gone, and is left alone.
        assert_eq!(here.destroy(&theirs.name).await.unwrap(), Teardown::Stopped);
        assert!(other_node.find(&theirs.name).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_container_without_billet_labels_is_never_listed_found_or_removed() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let lease = LeaseId::parse("l", &unique("t")).unwrap();
        let name = InstanceName::for_lease(&lease);
        let _leftovers = Leftovers(vec![name.to_string()]);
        let docker = provider.client("test").await.unwrap();
        docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.to_string()),
                    ..Default::default()
                }),
                ContainerCreateBody {
                    image: Some(TEST_IMAGE.to_owned()),
                    cmd: Some(vec!["/bin/sleep".to_owned(), "300".to_owned()]),
                    ..Default::default()
                },
            )
            .await
            .unwrap();

        assert!(provider.list().await.unwrap().is_empty());
        assert_eq!(provider.find(&name).await.unwrap(), None);
        assert_eq!(provider.destroy(&name).await.unwrap(), Teardown::Stopped);
        docker
            .inspect_container(name.as_str(), None)
            .await
            .expect("the unlabelled container is still there");
    }

    #[tokio::test]
    async fn a_start_failure_is_an_error_and_leaves_a_stopped_container_for_destroy() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let jit = unique("jit-secret");
        let mut spec = spec(&unique("t"), &jit);
        spec.command = vec!["/no/such/binary".to_owned()];
        let _leftovers = Leftovers(vec![spec.name.to_string()]);

        let err = provider.create(spec.clone()).await.unwrap_err().to_string();
        assert!(err.contains(&format!("start {}", spec.name)), "{err}");
        assert!(!err.contains(&jit), "{err}");
        let left = provider
            .find(&spec.name)
            .await
            .unwrap()
            .expect("created before start failed");
        assert_eq!(left.state, InstanceState::Created, "{left:?}");
        assert_eq!(
            provider.destroy(&spec.name).await.unwrap(),
            Teardown::Stopped
        );
        assert_eq!(provider.find(&spec.name).await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_name_in_use_or_a_missing_image_is_an_error_without_the_jit_config() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let jit = unique("jit-secret");
        let spec = spec(&unique("t"), &jit);
        let _leftovers = Leftovers(vec![spec.name.to_string()]);
        provider.create(spec.clone()).await.unwrap();
        let err = provider.create(spec.clone()).await.unwrap_err().to_string();
        assert!(err.contains("409"), "{err}");
        assert!(!err.contains(&jit), "{err}");

        let mut missing = spec_with_image(&unique("t"), &jit, "billet-test-no-such-image:none");
        missing.env.clear();
        let err = provider.create(missing).await.unwrap_err();
        assert!(
            matches!(&err, ProviderError::ImageUnavailable { image } if image == "billet-test-no-such-image:none"),
            "{err}"
        );
        assert!(!err.to_string().contains(&jit), "{err}");
    }

    fn spec_with_image(lease: &str, jit: &str, image: &str) -> InstanceSpec {
        let mut spec = spec(lease, jit);
        spec.image = image.to_owned();
        spec
    }

    #[tokio::test]
    async fn an_exited_container_is_listed_exited_with_its_code_until_destroyed() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let mut spec = spec(&unique("t"), &unique("jit"));
        spec.command = vec!["/bin/sleep".to_owned(), "0".to_owned()];
        let _leftovers = Leftovers(vec![spec.name.to_string()]);
        provider.create(spec.clone()).await.unwrap();

        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let instance = provider
                .find(&spec.name)
                .await
                .unwrap()
                .expect("still there");
            if let Some(exit) = instance.state.exit() {
                assert_eq!(
                    exit,
                    Exit {
                        code: 0,
                        oom_killed: false
                    }
                );
                assert!(!instance.may_run());
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "`sleep 0` still reads as running after 30s: {instance:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn a_bound_directory_is_what_the_container_reads_and_writes_at_its_path() {
        let provider = provider(owner(&unique("dep"), "node-a")).await;
        let host = std::env::temp_dir().join(unique("billet-bind"));
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(host.join("counter"), "41\n").unwrap();
        let mut spec = spec(&unique("t"), &unique("jit"));
        spec.command = vec![
            "/bin/sh".into(),
            "-c".into(),
            "read n < /cache/npm/counter && echo $((n + 1)) > /cache/npm/counter".into(),
        ];
        spec.binds = vec![crate::provider::Bind {
            host: host.clone(),
            guest: "/cache/npm".into(),
        }];
        let _leftovers = Leftovers(vec![spec.name.to_string()]);
        provider.create(spec.clone()).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let instance = provider.find(&spec.name).await.unwrap().expect("present");
            if let Some(exit) = instance.state.exit() {
                assert_eq!(exit.code, 0, "{instance:?}");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "still running after 30s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            std::fs::read_to_string(host.join("counter"))
                .unwrap()
                .trim(),
            "42"
        );
    }

    // ---- the provider contract (`contract.rs`) against the engine ------

    /// The Docker side of the provider contract: runners are the test
    /// image's `sh` and `sleep`, the faults are played through the engine.
    struct DockerDriver {
        provider: DockerProvider,
        created: std::sync::Mutex<Vec<String>>,
    }

    impl DockerDriver {
        async fn new() -> Self {
            Self {
                provider: provider(owner(&unique("dep"), "node-a")).await,
                created: std::sync::Mutex::new(Vec::new()),
            }
        }

        async fn docker(&self) -> &Docker {
            self.provider.client("test").await.unwrap()
        }
    }

    impl Drop for DockerDriver {
        fn drop(&mut self) {
            drop(Leftovers(std::mem::take(
                &mut *self.created.lock().unwrap(),
            )));
        }
    }

    #[async_trait]
    impl contract::Driver for DockerDriver {
        fn provider(&self) -> &dyn Provider {
            &self.provider
        }

        fn spec(&self, tag: &str, behaviour: contract::Behaviour) -> InstanceSpec {
            let mut spec = spec(&unique(tag), &unique("jit"));
            spec.memory = ByteSize(128 << 20);
            spec.command = match behaviour {
                contract::Behaviour::Work => vec!["/bin/sleep".into(), "300".into()],
                contract::Behaviour::Exit(code) => {
                    vec!["/bin/sh".into(), "-c".into(), format!("exit {code}")]
                }
                // The string doubles until the limit's OOM killer ends it.
                // The host's `sleep`, under the job process's name.
                contract::Behaviour::Job => {
                    vec![
                        format!("/bin/{}", crate::provider::JOB_PROCESS),
                        "300".into(),
                    ]
                }
                contract::Behaviour::Allocate => vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    "a=0123456789abcdef; while :; do a=$a$a; done".into(),
                ],
            };
            self.created.lock().unwrap().push(spec.name.to_string());
            spec
        }

        async fn enact(&self, _name: &InstanceName, _behaviour: contract::Behaviour) {}

        async fn kill(&self, name: &InstanceName) {
            self.docker()
                .await
                .kill_container(
                    name.as_str(),
                    None::<bollard::query_parameters::KillContainerOptions>,
                )
                .await
                .unwrap_or_else(|err| panic!("docker kill {name}: {err}"));
        }

        async fn remove_out_of_band(&self, name: &InstanceName) {
            let options = RemoveContainerOptions {
                force: true,
                ..Default::default()
            };
            self.docker()
                .await
                .remove_container(name.as_str(), Some(options))
                .await
                .unwrap_or_else(|err| panic!("docker rm -f {name}: {err}"));
        }

        async fn unreachable(&self) -> Box<dyn Provider> {
            // A socket file nobody listens on any more: connections are
            // refused.
            let path = std::env::temp_dir().join(unique("billet-dead-engine"));
            drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
            Box::new(
                DockerProvider::connect(&path, self.provider.owner().clone())
                    .unwrap()
                    .without_handoff_wait()
                    .with_timeout(Duration::from_secs(5)),
            )
        }

        async fn hanging(&self, bound: Duration) -> Box<dyn Provider> {
            // Accepts every connection and never reads or answers.
            let path = std::env::temp_dir().join(unique("billet-hung-engine"));
            let listener = tokio::net::UnixListener::bind(&path).unwrap();
            tokio::spawn(async move {
                let mut held = Vec::new();
                while let Ok((stream, _)) = listener.accept().await {
                    held.push(stream);
                }
            });
            Box::new(
                DockerProvider::connect(&path, self.provider.owner().clone())
                    .unwrap()
                    .without_handoff_wait()
                    .with_timeout(bound),
            )
        }

        fn missing_image(&self) -> String {
            "billet-test-no-such-image:none".to_owned()
        }
    }

    #[tokio::test]
    async fn docker_reads_a_runner_busy_exactly_while_its_job_process_runs() {
        contract::a_runner_is_busy_exactly_while_its_job_process_runs(&DockerDriver::new().await)
            .await;
    }

    #[tokio::test]
    async fn docker_keeps_an_exited_container_with_its_code_until_destroyed() {
        contract::an_exited_instance_is_present_with_its_code_until_destroyed(
            &DockerDriver::new().await,
        )
        .await;
    }

    #[tokio::test]
    async fn docker_reports_a_container_oom_killed_under_128_mib() {
        contract::an_oom_killed_instance_says_so(&DockerDriver::new().await).await;
    }

    #[tokio::test]
    async fn docker_reports_a_docker_kill_as_137_without_oom() {
        contract::a_killed_instance_is_exited_137_without_the_oom_flag(&DockerDriver::new().await)
            .await;
    }

    #[tokio::test]
    async fn docker_forgets_a_container_removed_out_of_band() {
        contract::an_instance_removed_out_of_band_is_absent(&DockerDriver::new().await).await;
    }

    #[tokio::test]
    async fn docker_leaves_a_created_container_unstarted_when_its_start_is_withheld() {
        contract::a_create_whose_start_is_withheld_leaves_the_instance_created_until_destroyed(
            &DockerDriver::new().await,
        )
        .await;
    }

    #[tokio::test]
    async fn docker_refuses_a_missing_image_before_and_at_create() {
        contract::a_missing_image_is_unavailable_and_creates_nothing(&DockerDriver::new().await)
            .await;
    }

    #[tokio::test]
    async fn docker_with_nothing_listening_fails_every_call_typed() {
        contract::an_unreachable_engine_fails_every_call_typed(&DockerDriver::new().await).await;
    }

    #[tokio::test]
    async fn docker_with_an_engine_that_never_answers_fails_every_call_typed_within_its_bound() {
        contract::a_hanging_engine_fails_every_call_typed_within_its_bound(
            &DockerDriver::new().await,
        )
        .await;
    }
}
