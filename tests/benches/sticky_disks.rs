//! Sticky disks: what a mount and a commit cost on the file system the
//! cache is on, against baselines measured in the same run.
//!
//! The node's own store (`billet_agent::cache::Store`, its mounts journaled
//! in a real SQLite node journal on the host's disk) on two file systems:
//! an XFS made with `reflink=1` on a sparse image this bench loop-mounts
//! and removes, and the host's own (ext4 here), where a mount is a sparse
//! copy. On each, two keys get one generation each of `FILES` files
//! (`BILLET_BENCH_FILES`, 256 by default): 1 GiB and 10 GiB (files ten times
//! larger, the same number of them).
//!
//! 1. **Mount**: `Store::mount` of each generation (journal the intent,
//!    clone the tree, refresh its last use), `SAMPLES` times each (median);
//!    the 10 GiB ÷ 1 GiB ratio, and each against two baselines: making an
//!    empty directory (and syncing its parent), and one `FICLONE` of one of
//!    the generation's files (on ext4, one sparse copy of it).
//! 2. **Commit where 1% changed**: a mount of the 1 GiB generation whose
//!    job overwrites 1% of its bytes in place; the end-of-job commit
//!    (`Store::commit`: sync, rename, state) ÷ writing that 1% to a new file
//!    and syncing it. Also the guest's commit (`Store::commit_now`, the tree
//!    cloned aside while the job still runs) ÷ the same baseline.
//!
//! ```text
//! cargo bench -p billet-tests --bench sticky_disks
//! BILLET_BENCH_FILES=1000 cargo bench -p billet-tests --bench sticky_disks
//! BILLET_BENCH_HOST_MIB=64 BILLET_BENCH_PREALLOCATE=1 cargo bench -p billet-tests --bench sticky_disks
//! ```
//!
//! `BILLET_BENCH_XFS_MIB` and `BILLET_BENCH_HOST_MIB` set each pass's
//! smaller generation (1024 MiB by default; the larger is ten times it);
//! `BILLET_BENCH_PREALLOCATE` makes the XFS pass's files with `fallocate(2)`
//! instead of writing them. It needs root and `mkfs.xfs` (xfsprogs), and
//! free room on the temporary directory's disk: about 12 GiB for the XFS
//! image (little when preallocated) and 22 times the host pass's smaller
//! generation. Run without `--bench` (as `cargo test --benches` does), it makes
//! one small unmeasured pass (8 MiB and 80 MiB, 16 files).

use std::io::Write as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, Result, ensure};
use billet_agent::cache::clone::ReflinkSupport;
use billet_agent::cache::{Committed, DiskKey, Policy, Store};
use billet_agent::journal::SqliteJournal;
use billet_agent::model::LeaseId;
use billet_tests::bench::Samples;
use billet_tests::scratchfs::ScratchFs;

struct Config {
    files: u64,
    /// The XFS pass's small generation, in bytes (the large one is ten
    /// times it).
    small_bytes: u64,
    /// The host pass's (every mount copies it, so it takes that much disk
    /// again).
    host_small_bytes: u64,
    /// Make the XFS pass's files with `fallocate(2)` (allocated, unwritten
    /// extents) instead of writing them: the image then needs no room on
    /// the host's disk for their data.
    preallocate: bool,
    samples: usize,
    /// Samples of the ext4 10 GiB mount (each copies 10 GiB).
    large_copy_samples: usize,
}

/// A size in MiB from the environment variable `name`, or `default`.
fn mib(name: &str, default: u64) -> Result<u64> {
    match std::env::var(name) {
        Ok(v) => v
            .parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .map(|n| n << 20)
            .with_context(|| format!("{name}={v:?}: give a positive number of MiB")),
        Err(_) => Ok(default),
    }
}

fn config(measuring: bool) -> Result<Config> {
    let files = match std::env::var("BILLET_BENCH_FILES") {
        Ok(v) => v
            .parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("BILLET_BENCH_FILES={v:?}: give a positive count"))?,
        Err(_) if measuring => 256,
        Err(_) => 16,
    };
    Ok(if measuring {
        Config {
            files,
            small_bytes: mib("BILLET_BENCH_XFS_MIB", 1 << 30)?,
            host_small_bytes: mib("BILLET_BENCH_HOST_MIB", 1 << 30)?,
            preallocate: std::env::var_os("BILLET_BENCH_PREALLOCATE").is_some(),
            samples: 7,
            large_copy_samples: 2,
        }
    } else {
        Config {
            files,
            small_bytes: 8 << 20,
            host_small_bytes: 8 << 20,
            preallocate: false,
            samples: 1,
            large_copy_samples: 1,
        }
    })
}

fn main() -> ExitCode {
    let measuring = std::env::args().any(|a| a == "--bench");
    let config = match config(measuring) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sticky_disks bench: {e:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sticky_disks bench: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(&config, measuring)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sticky_disks bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(config: &Config, measuring: bool) -> Result<()> {
    println!(
        "sticky disks: generations of {} files; {} samples (median){}",
        config.files,
        config.samples,
        if measuring { "" } else { " (smoke pass)" }
    );
    let tmp = std::env::temp_dir();
    let xfs = ScratchFs::xfs_reflink(&tmp, ((config.small_bytes * 11) >> 30) + 4)?;
    let on_xfs = measure(
        "xfs (reflink=1, loop)",
        &xfs.path,
        config,
        config.small_bytes,
        config.preallocate,
        config.samples,
    )
    .await?;
    drop(xfs);
    let host = billet_tests::cluster::scratch_dir("sticky-bench")?;
    let on_host = measure(
        "host (the temporary directory's disk)",
        &host,
        config,
        config.host_small_bytes,
        false,
        config.large_copy_samples,
    )
    .await;
    let _ = std::fs::remove_dir_all(&host);
    let on_host = on_host?;
    ensure!(
        on_xfs.reflink,
        "the XFS made with reflink=1 did not reflink: {:?}",
        on_xfs.kind
    );
    println!();
    println!(
        "summary (goals: mount the same for 1 and 10 GiB and under 50 ms; commit of 1% ≤ 3 × writing it)"
    );
    for m in [&on_xfs, &on_host] {
        println!(
            "  {:<6} {:<7} mount {} MiB {:>9.2} ms  {} MiB {:>9.2} ms  ratio {:>6.2}  commit 1% ÷ write 1% {:>5.2}  guest commit ÷ write 1% {:>7.2}",
            m.kind,
            if m.reflink { "reflink" } else { "copy" },
            m.small_bytes >> 20,
            m.mount_small_ms,
            (m.small_bytes * 10) >> 20,
            m.mount_large_ms,
            m.mount_large_ms / m.mount_small_ms,
            m.commit_ms / m.write_ms,
            m.guest_commit_ms / m.write_ms,
        );
    }
    Ok(())
}

/// One file system's figures, in milliseconds (medians).
struct Figures {
    kind: String,
    small_bytes: u64,
    reflink: bool,
    mount_small_ms: f64,
    mount_large_ms: f64,
    commit_ms: f64,
    guest_commit_ms: f64,
    write_ms: f64,
}

fn lease(n: usize) -> LeaseId {
    LeaseId::parse("bench.lease", &format!("bench-{n}")).expect("a lease id")
}

/// Writes `files` files of `bytes / files` bytes each under `dir`, in two
/// levels of directories, as a cache tree would be; with `preallocate`,
/// each file's blocks are allocated (`fallocate(2)`) and not written.
fn write_tree(dir: &Path, files: u64, bytes: u64, preallocate: bool) -> Result<()> {
    let each = bytes / files;
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    for f in 0..files {
        let sub = dir.join(format!("d{:02}", f % 16));
        std::fs::create_dir_all(&sub)?;
        let mut file = std::fs::File::create(sub.join(format!("f{f:05}")))?;
        if preallocate {
            rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, each)?;
            continue;
        }
        let mut left = each;
        while left > 0 {
            let n = usize::try_from(left.min(chunk.len() as u64)).unwrap_or(chunk.len());
            file.write_all(&chunk[..n])?;
            left -= n as u64;
        }
    }
    Ok(())
}

/// Overwrites, in place, the first files of the tree at `dir` until
/// `bytes` were written; the bytes written.
fn overwrite(dir: &Path, bytes: u64) -> Result<u64> {
    let mut files: Vec<PathBuf> = Vec::new();
    for sub in std::fs::read_dir(dir)? {
        for f in std::fs::read_dir(sub?.path())? {
            files.push(f?.path());
        }
    }
    files.sort();
    let chunk = vec![0x5au8; 1 << 20];
    let mut written = 0u64;
    for path in files {
        let file = std::fs::OpenOptions::new().write(true).open(&path)?;
        let len = file.metadata()?.len();
        let mut at = 0;
        while at < len && written < bytes {
            let n = (len - at).min(bytes - written).min(chunk.len() as u64);
            file.write_all_at(&chunk[..usize::try_from(n)?], at)?;
            at += n;
            written += n;
        }
        if written >= bytes {
            break;
        }
    }
    Ok(written)
}

/// Flushes the file system `dir` is on (`sync -f`: syncfs(2)), so what
/// is measured next does not pay for what was written before.
fn syncfs(dir: &Path) -> Result<()> {
    let status = std::process::Command::new("sync")
        .arg("-f")
        .arg(dir)
        .status()?;
    ensure!(status.success(), "sync -f {}: {status}", dir.display());
    Ok(())
}

/// Publishes one generation of `key` holding `bytes` in `files` files.
async fn publish(
    store: &Store,
    n: usize,
    key: &DiskKey,
    (files, bytes, preallocate): (u64, u64, bool),
) -> Result<()> {
    let mount = store.mount(&lease(n), key, Policy::Cas).await?;
    let dir = mount.dir.clone();
    tokio::task::spawn_blocking(move || write_tree(&dir, files, bytes, preallocate)).await??;
    let committed = store.commit(&mount.id).await?;
    ensure!(
        matches!(committed, Committed::Published(_)),
        "{committed:?}"
    );
    Ok(())
}

async fn measure(
    label: &str,
    root: &Path,
    config: &Config,
    small_bytes: u64,
    preallocate: bool,
    large_samples: usize,
) -> Result<Figures> {
    let cache = root.join("cache");
    let state = billet_tests::cluster::scratch_dir("sticky-bench-state")?;
    let journal = Arc::new(SqliteJournal::open(&state).await?);
    let store = Store::open(&cache, "bench", journal).await?;
    let fs = store.filesystem().clone();
    println!();
    println!(
        "{label}: {} at {}, clone by {}; generations of {small_bytes} and {} bytes{}",
        fs.kind,
        root.display(),
        fs.method().as_str(),
        small_bytes * 10,
        if preallocate {
            ", preallocated (fallocate: allocated, unwritten extents)"
        } else {
            ", written"
        }
    );
    let small = DiskKey::parse("bench-1gib")?;
    let large = DiskKey::parse("bench-10gib")?;
    let started = Instant::now();
    publish(&store, 0, &small, (config.files, small_bytes, preallocate)).await?;
    publish(
        &store,
        0,
        &large,
        (config.files, small_bytes * 10, preallocate),
    )
    .await?;
    syncfs(&cache)?;
    println!(
        "  generations written and synced in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Baselines: an empty directory made (its parent synced), and one
    // clone of one file of the small generation.
    let mut mkdir = Samples::default();
    let mut one_clone = Samples::default();
    let scratch = cache.join("bench-baseline");
    std::fs::create_dir_all(&scratch)?;
    let one_file = store
        .generation_dir(&small, billet_agent::cache::Generation(1))
        .join("d00")
        .join("f00000");
    for i in 0..config.samples.max(5) {
        let dir = scratch.join(format!("empty-{i}"));
        let t = Instant::now();
        std::fs::create_dir(&dir)?;
        std::fs::File::open(&scratch)?.sync_all()?;
        mkdir.push(t.elapsed());
        let support = ReflinkSupport::default();
        let dst = scratch.join(format!("clone-{i}"));
        // One file: a tree of one file, cloned as a mount clones it.
        let single = scratch.join(format!("single-{i}"));
        std::fs::create_dir(&single)?;
        std::fs::hard_link(&one_file, single.join("f"))?;
        let t = Instant::now();
        billet_agent::cache::clone::clone_tree(&single, &dst, &support)?;
        one_clone.push(t.elapsed());
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let file_bytes = small_bytes / config.files;
    println!(
        "  baseline: empty directory {:.3} ms; one file of {} bytes cloned {:.3} ms",
        mkdir.median_ms(),
        file_bytes,
        one_clone.median_ms()
    );

    // Mounts.
    let mut mounts = [Samples::default(), Samples::default()];
    for (i, (key, samples)) in [(&small, config.samples), (&large, large_samples)]
        .into_iter()
        .enumerate()
    {
        for s in 0..samples {
            syncfs(&cache)?;
            let t = Instant::now();
            let mount = store.mount(&lease(100 + s), key, Policy::Cas).await?;
            mounts[i].push(t.elapsed());
            ensure!(mount.parent.is_some() && mount.committable, "{mount:?}");
            store.discard(&mount.id).await?;
        }
    }
    let (small_ms, large_ms) = (mounts[0].median_ms(), mounts[1].median_ms());
    println!(
        "  mount 1 GiB-class ({} bytes): median {:.2} ms (min {:.2}, max {:.2}) = {:.1} × empty directory, {:.1} × one file's clone",
        small_bytes,
        small_ms,
        mounts[0].min_ms(),
        mounts[0].max_ms(),
        small_ms / mkdir.median_ms(),
        small_ms / one_clone.median_ms()
    );
    println!(
        "  mount 10 GiB-class ({} bytes): median {:.2} ms (min {:.2}, max {:.2}) = {:.1} × empty directory, {:.1} × one file's clone",
        small_bytes * 10,
        large_ms,
        mounts[1].min_ms(),
        mounts[1].max_ms(),
        large_ms / mkdir.median_ms(),
        large_ms / one_clone.median_ms()
    );
    println!("  mount 10 GiB ÷ mount 1 GiB: {:.2}", large_ms / small_ms);

    // Commits of a mount whose job changed 1% of its bytes.
    let one_percent = small_bytes / 100;
    let mut write = Samples::default();
    let mut commit = Samples::default();
    let mut guest = Samples::default();
    let chunk = vec![0x5au8; 1 << 20];
    for s in 0..config.samples {
        // Baseline: the 1% written to a new file and synced.
        syncfs(&cache)?;
        let path = cache.join(format!("bench-write-{s}"));
        let t = Instant::now();
        let mut file = std::fs::File::create(&path)?;
        let mut left = one_percent;
        while left > 0 {
            let n = left.min(chunk.len() as u64);
            file.write_all(&chunk[..usize::try_from(n)?])?;
            left -= n;
        }
        file.sync_all()?;
        write.push(t.elapsed());
        drop(file);
        std::fs::remove_file(&path)?;

        for guest_commit in [false, true] {
            let mount = store.mount(&lease(200 + s), &small, Policy::Cas).await?;
            syncfs(&cache)?;
            let dir = mount.dir.clone();
            let written =
                tokio::task::spawn_blocking(move || overwrite(&dir, one_percent)).await??;
            ensure!(written == one_percent, "wrote {written} of {one_percent}");
            let t = Instant::now();
            let committed = if guest_commit {
                store.commit_now(&mount.id).await?
            } else {
                store.commit(&mount.id).await?
            };
            let took = t.elapsed();
            ensure!(
                matches!(committed, Committed::Published(_)),
                "{committed:?}"
            );
            if guest_commit {
                guest.push(took);
                store.discard(&mount.id).await?;
            } else {
                commit.push(took);
            }
            // The superseded generation goes, so the disk holds two trees.
            store
                .evict(
                    billet_agent::cache::Eviction::default(),
                    i64::try_from(
                        std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)?
                            .as_millis(),
                    )?,
                )
                .await?;
        }
    }
    println!(
        "  write 1% ({one_percent} bytes) to a new file and sync it: median {:.2} ms",
        write.median_ms()
    );
    println!(
        "  commit after 1% changed (sync, rename, state): median {:.2} ms = {:.2} × writing the 1%",
        commit.median_ms(),
        commit.median_ms() / write.median_ms()
    );
    println!(
        "  guest commit after 1% changed (tree cloned aside): median {:.2} ms = {:.2} × writing the 1%",
        guest.median_ms(),
        guest.median_ms() / write.median_ms()
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_dir_all(&cache);
    Ok(Figures {
        kind: fs.kind,
        small_bytes,
        reflink: fs.reflink,
        mount_small_ms: small_ms,
        mount_large_ms: large_ms,
        commit_ms: commit.median_ms(),
        guest_commit_ms: guest.median_ms(),
        write_ms: write.median_ms(),
    })
}
