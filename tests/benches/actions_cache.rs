//! Restoring an Actions cache archive through the node's proxy against
//! reading the same bytes from the same disk, measured in one run.
//!
//! The node's proxy (`billet_agent::cache::actions`) runs in this process
//! on loopback with a real interception CA; an archive of
//! `BILLET_BENCH_BYTES` (1 GiB) is saved through it as `@actions/cache`
//! does (create, one `PUT`, finalize) and looked up. Then, in each of
//! `BILLET_BENCH_ROUNDS` rounds (5), the two sides take turns (which goes
//! first alternates by round):
//!
//! - **the baseline** reads the published archive file (256 KiB reads);
//! - **the restore** downloads it as `@actions/cache` does: the lookup
//!   through the proxy (a CONNECT tunnel, TLS 1.3 trusting the node's
//!   CA), then `GET` of the signed download URL, which is on the proxy's
//!   listener and fetched straight there over plain HTTP, the body read
//!   in 256 KiB reads (`BILLET_BENCH_TUNNEL=1`: the same URL's path in a
//!   tunnel instead, as a node before direct downloads served it). The
//!   client is in this process, so it shares the machine with the proxy,
//!   as a guest would.
//!
//! Each side reads **cold** first: before each read the archive is synced
//! and its pages dropped from the page cache (`posix_fadvise(DONTNEED)`
//! on that file alone), and `fincore` (util-linux, which asks `mincore`)
//! must then find at most 1% of it resident, else the bench fails; this is
//! the headline figure, both sides reading the same bytes from the same
//! disk. Then each reads **warm** (`fincore` must find at least 99% of it
//! cached):
//! the proxy's raw cost (TLS, HTTP, copies) over the cheapest read there
//! is, printed as such with no goal. Printed for each: the median and the
//! best time and throughput, and the ratios restore / baseline throughput
//! of the medians and of the bests (goal for cold: at least 0.8).
//!
//! On a virtual machine "the disk" is the hypervisor's block device, which
//! may itself be cached by the host: what the guest's page cache does not
//! hold is read through it either way, the same for both sides.
//!
//! ```text
//! cargo bench -p billet-tests --bench actions_cache
//! BILLET_BENCH_BYTES=268435456 BILLET_BENCH_ROUNDS=7 cargo bench -p billet-tests --bench actions_cache
//! ```
//!
//! The archive lives under `BILLET_BENCH_DIR` (default: the temporary
//! directory), which must be on a disk, not a tmpfs. Run without `--bench`
//! (as `cargo test --benches` does), it makes one small unmeasured pass,
//! cold and warm, as a smoke test.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use base64::Engine as _;
use billet_agent::cache::actions::archives::Archives;
use billet_agent::cache::actions::ca::InterceptionCa;
use billet_agent::cache::actions::proxy::{ActionsProxy, Upstream};
use billet_agent::cache::actions::{CacheScope, FakeAnswer, FakePolicy, RESULTS_HOST};
use billet_agent::cache::session::CacheToken;
use billet_agent::journal::MemoryJournal;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const UA: &str = "@actions/cache-4.0.3";
const TWIRP: &str = "/twirp/github.actions.results.api.v1.CacheService/";
const CHUNK: usize = 256 << 10;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Client {
    proxy: String,
    auth: String,
    tls: tokio_rustls::TlsConnector,
}

type Tunnel = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

impl Client {
    async fn tunnel(&self) -> Result<Tunnel> {
        let mut tcp = tokio::net::TcpStream::connect(&self.proxy).await?;
        tcp.set_nodelay(true)?;
        tcp.write_all(
            format!(
                "CONNECT {RESULTS_HOST}:443 HTTP/1.1\r\nHost: {RESULTS_HOST}:443\r\nProxy-Authorization: Basic {}\r\n\r\n",
                self.auth
            )
            .as_bytes(),
        )
        .await?;
        let (head, _) = head(&mut tcp).await?;
        anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "CONNECT: {head}");
        Ok(self
            .tls
            .connect(rustls::pki_types::ServerName::try_from(RESULTS_HOST)?, tcp)
            .await?)
    }

    /// Sends a request whose body is `body_len` bytes from `body`; returns
    /// the status, the head, and the tunnel positioned at the body.
    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &mut (dyn FnMut(&mut [u8]) -> usize + Send),
        body_len: u64,
    ) -> Result<(u16, String, usize, Tunnel)> {
        let mut t = self.tunnel().await?;
        let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: {RESULTS_HOST}\r\n");
        for (k, v) in headers {
            raw.push_str(&format!("{k}: {v}\r\n"));
        }
        raw.push_str(&format!("Content-Length: {body_len}\r\n\r\n"));
        t.write_all(raw.as_bytes()).await?;
        let mut buf = vec![0u8; CHUNK];
        let mut sent = 0u64;
        while sent < body_len {
            let n = body(&mut buf);
            t.write_all(&buf[..n]).await?;
            sent += n as u64;
        }
        t.flush().await?;
        let (head, length) = head(&mut t).await?;
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("status")?;
        Ok((status, head, length, t))
    }

    async fn json(&self, method: &str, body: serde_json::Value) -> Result<serde_json::Value> {
        let text = body.to_string().into_bytes();
        let mut once = Some(text.clone());
        let (_, _, length, mut t) = self
            .send(
                "POST",
                &format!("{TWIRP}{method}"),
                &[("Content-Type", "application/json"), ("User-Agent", UA)],
                &mut |buf: &mut [u8]| {
                    let b = once.take().unwrap_or_default();
                    buf[..b.len()].copy_from_slice(&b);
                    b.len()
                },
                text.len() as u64,
            )
            .await?;
        let mut body = vec![0u8; length];
        t.read_exact(&mut body).await?;
        Ok(serde_json::from_slice(&body)?)
    }
}

/// Reads a head; its text and `Content-Length`.
async fn head<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Result<(String, usize)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        anyhow::ensure!(s.read(&mut byte).await? == 1, "closed before a head");
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let length = billet_tests::results::content_length(&head);
    Ok((head, length))
}

fn path_of(url: &str) -> String {
    url.trim_start_matches(&format!("https://{RESULTS_HOST}"))
        .to_owned()
}

async fn run(measuring: bool) -> Result<()> {
    let bytes = if measuring {
        env_or("BILLET_BENCH_BYTES", 1 << 30)
    } else {
        8 << 20
    };
    let rounds = if measuring {
        env_or("BILLET_BENCH_ROUNDS", 5).max(1)
    } else {
        1
    };
    let base = std::env::var_os("BILLET_BENCH_DIR")
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    let dir = base.join(format!(
        "billet-bench-actions-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir)?;
    let result = measure(&dir, bytes, rounds).await;
    let _ = std::fs::remove_dir_all(&dir);
    let figures = result?;
    if !measuring {
        println!("actions cache restore: smoke pass of {bytes} bytes, cold and warm, unmeasured");
        return Ok(());
    }
    let gib_s = |d: Duration| bytes as f64 / d.as_secs_f64() / f64::from(1u32 << 30);
    let line = |label: &str, times: &[Duration]| {
        let (median, best) = median_best(times);
        println!(
            "  {label:<44} median {:7.3} s {:6.2} GiB/s, best {:7.3} s {:6.2} GiB/s",
            median.as_secs_f64(),
            gib_s(median),
            best.as_secs_f64(),
            gib_s(best)
        );
    };
    // Throughput restore / baseline = time baseline / time restore.
    let ratio = |baseline: &[Duration], restore: &[Duration]| {
        let ((bm, bb), (rm, rb)) = (median_best(baseline), median_best(restore));
        (
            bm.as_secs_f64() / rm.as_secs_f64(),
            bb.as_secs_f64() / rb.as_secs_f64(),
        )
    };
    println!("actions cache restore: {bytes} bytes, {rounds} interleaved rounds");
    println!(" cold: the archive's pages evicted before each read (checked with fincore)");
    line(
        "baseline, the archive read off the disk:",
        &figures.baseline_cold,
    );
    line(
        "restored via the proxy's download URL:",
        &figures.restore_cold,
    );
    let (median, best) = ratio(&figures.baseline_cold, &figures.restore_cold);
    println!(
        "  ratio restore / baseline throughput, cold:   median {median:.2}, best {best:.2} (goal >= 0.8)"
    );
    println!(" warm: every page in the page cache (the proxy's raw cost, no goal)");
    line(
        "baseline, the archive read from the cache:",
        &figures.baseline_warm,
    );
    line(
        "restored via the proxy's download URL:",
        &figures.restore_warm,
    );
    let (median, best) = ratio(&figures.baseline_warm, &figures.restore_warm);
    println!("  ratio restore / baseline throughput, warm:   median {median:.2}, best {best:.2}");
    Ok(())
}

async fn measure(dir: &std::path::Path, bytes: u64, rounds: u64) -> Result<Figures> {
    let journal = Arc::new(MemoryJournal::default());
    let policy = Arc::new(FakePolicy::new(FakeAnswer::Allow));
    let archives = Archives::open(dir, journal, policy).await?;
    let ca = Arc::new(InterceptionCa::load_or_create(dir)?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let proxy = ActionsProxy::new(
        archives.clone(),
        ca.clone(),
        Upstream::new(None, None)?,
        addr,
    )?;
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(proxy.clone().serve(listener, stop.clone()));
    let token = CacheToken::mint()?;
    archives
        .open_session(
            "bench",
            &token,
            CacheScope::new("octo", "app", "octo/app/.github/workflows/ci.yml@main")?,
        )
        .await?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile_certs(ca.ca_pem().as_bytes()) {
        roots.add(cert)?;
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let client = Client {
        proxy: addr.to_string(),
        auth: base64::engine::general_purpose::STANDARD
            .encode(format!("billet:{}", token.expose())),
        tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
    };
    // Save.
    let created = client
        .json(
            "CreateCacheEntry",
            serde_json::json!({"key": "bench", "version": "v1"}),
        )
        .await?;
    let upload = path_of(
        created["signed_upload_url"]
            .as_str()
            .context("upload URL")?,
    );
    let mut byte = 0u8;
    let (status, head, _, _) = client
        .send(
            "PUT",
            &upload,
            &[("x-ms-blob-type", "BlockBlob")],
            &mut |buf: &mut [u8]| {
                for b in buf.iter_mut() {
                    *b = byte;
                    byte = byte.wrapping_add(1);
                }
                buf.len()
            },
            bytes,
        )
        .await?;
    anyhow::ensure!(status == 201, "PUT: {head}");
    let fin = client
        .json(
            "FinalizeCacheEntryUpload",
            serde_json::json!({"key": "bench", "version": "v1", "size_bytes": bytes}),
        )
        .await?;
    anyhow::ensure!(fin["ok"] == true, "finalize: {fin}");
    let found = client
        .json(
            "GetCacheEntryDownloadURL",
            serde_json::json!({"key": "bench", "version": "v1"}),
        )
        .await?;
    let mut download = found["signed_download_url"]
        .as_str()
        .context("download URL")?
        .to_owned();
    anyhow::ensure!(
        download.starts_with("http://"),
        "the download URL is not on the proxy's listener: {download}"
    );
    if std::env::var_os("BILLET_BENCH_TUNNEL").is_some() {
        // The same URL's path in a tunnel, as a node before direct
        // downloads served it: for a comparison in the same build.
        download = download[download.find("/_billet/").context("blob path")?..].to_owned();
        println!("restoring in a TLS tunnel (BILLET_BENCH_TUNNEL)");
    }
    let archive = archives
        .entries()?
        .first()
        .context("the published entry")?
        .dir
        .join("archive");
    let mut figures = Figures::default();
    for round in 0..rounds {
        // Alternate which side goes first, so neither always follows the
        // other's reads.
        let sides = if round % 2 == 0 {
            [Side::Baseline, Side::Restore]
        } else {
            [Side::Restore, Side::Baseline]
        };
        for side in sides {
            evict(&archive, bytes)?;
            let took = match side {
                Side::Baseline => read_file(&archive, bytes).await?,
                Side::Restore => restore(&client, &download, bytes).await?,
            };
            figures.push(side, Cache::Cold, took);
        }
        // The cold reads left the archive cached. Not always every page: a
        // proactive reclaimer (DAMON's pageout on some kernels) may already
        // be taking back what it deems cold.
        let resident = resident_bytes(&archive)?;
        anyhow::ensure!(
            resident >= bytes - bytes / 100,
            "after the cold reads only {resident} of {bytes} bytes are in the page cache"
        );
        for side in sides {
            let took = match side {
                Side::Baseline => read_file(&archive, bytes).await?,
                Side::Restore => restore(&client, &download, bytes).await?,
            };
            figures.push(side, Cache::Warm, took);
        }
    }
    stop.cancel();
    archives.close("bench").await;
    Ok(figures)
}

#[derive(Clone, Copy)]
enum Side {
    /// The archive file read straight off the disk.
    Baseline,
    /// The archive downloaded through the proxy.
    Restore,
}

#[derive(Clone, Copy)]
enum Cache {
    /// The archive's pages evicted before the read.
    Cold,
    /// Every page of the archive in the page cache.
    Warm,
}

/// Each timed read, by side and cache state, in the order taken.
#[derive(Default)]
struct Figures {
    baseline_cold: Vec<Duration>,
    restore_cold: Vec<Duration>,
    baseline_warm: Vec<Duration>,
    restore_warm: Vec<Duration>,
}

impl Figures {
    fn push(&mut self, side: Side, cache: Cache, took: Duration) {
        match (side, cache) {
            (Side::Baseline, Cache::Cold) => self.baseline_cold.push(took),
            (Side::Restore, Cache::Cold) => self.restore_cold.push(took),
            (Side::Baseline, Cache::Warm) => self.baseline_warm.push(took),
            (Side::Restore, Cache::Warm) => self.restore_warm.push(took),
        }
    }
}

/// The median and the best of `times`.
fn median_best(times: &[Duration]) -> (Duration, Duration) {
    let mut sorted = times.to_vec();
    sorted.sort();
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2
    };
    (median, sorted[0])
}

/// Drops the archive's pages from the page cache (written back first, so
/// none is dirty and kept) and checks with `fincore` that none is left:
/// the next read comes from the disk.
fn evict(archive: &std::path::Path, bytes: u64) -> Result<()> {
    let f = std::fs::File::open(archive)?;
    f.sync_all()?;
    rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
    let resident = resident_bytes(archive)?;
    // A page or two may be read back by the file system; more is a failed
    // eviction (a tmpfs, for one, cannot evict: set BILLET_BENCH_DIR).
    anyhow::ensure!(
        resident <= bytes / 100,
        "evicting the archive's pages left {resident} of {bytes} bytes in the page cache"
    );
    Ok(())
}

/// How many bytes of `path` are in the page cache, from util-linux's
/// `fincore` (which asks `mincore`).
fn resident_bytes(path: &std::path::Path) -> Result<u64> {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--raw", "--output", "RES"])
        .arg(path)
        .output()
        .context("running fincore (util-linux), which checks the page cache")?;
    anyhow::ensure!(
        out.status.success(),
        "fincore: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("fincore's RES column")
}

/// The baseline: `archive` read whole, 256 KiB reads, on a blocking thread.
async fn read_file(archive: &std::path::Path, bytes: u64) -> Result<Duration> {
    let started = Instant::now();
    let path = archive.to_owned();
    let read = tokio::task::spawn_blocking(move || -> std::io::Result<u64> {
        use std::io::Read as _;
        let mut f = std::fs::File::open(path)?;
        let mut buf = vec![0u8; CHUNK];
        let mut total = 0u64;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
        }
    })
    .await??;
    let took = started.elapsed();
    anyhow::ensure!(read == bytes, "the baseline read {read} bytes");
    Ok(took)
}

/// The restore: `GET` of the signed URL as `@actions/cache` fetches it
/// (an `http://` URL on the proxy's listener straight there, with no
/// proxy and no TLS; a path on the results host in a tunnel), the body
/// read whole in 256 KiB reads.
async fn restore(client: &Client, url: &str, bytes: u64) -> Result<Duration> {
    let started = Instant::now();
    if let Some(rest) = url.strip_prefix("http://") {
        let (authority, target) = rest.split_at(rest.find('/').context("a path")?);
        let mut tcp = tokio::net::TcpStream::connect(authority).await?;
        tcp.set_nodelay(true)?;
        tcp.write_all(format!("GET {target} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
            .await?;
        let (head, length) = head(&mut tcp).await?;
        anyhow::ensure!(
            head.starts_with("HTTP/1.1 200") && length as u64 == bytes,
            "GET: {head}"
        );
        read_body(&mut tcp, bytes).await?;
        return Ok(started.elapsed());
    }
    let (status, head, length, mut t) = client
        .send("GET", url, &[], &mut |_: &mut [u8]| 0, 0)
        .await?;
    anyhow::ensure!(status == 200 && length as u64 == bytes, "GET: {head}");
    read_body(&mut t, bytes).await?;
    Ok(started.elapsed())
}

/// Reads `bytes` of body in 256 KiB reads.
async fn read_body<S: tokio::io::AsyncRead + Unpin>(s: &mut S, bytes: u64) -> Result<()> {
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    while total < bytes {
        let n = s.read(&mut buf).await?;
        anyhow::ensure!(n > 0, "the download ended at {total} bytes");
        total += n as u64;
    }
    Ok(())
}

fn rustls_pemfile_certs(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect()
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    let measuring = std::env::args().any(|a| a == "--bench");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("actions cache bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(measuring)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("actions cache bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
