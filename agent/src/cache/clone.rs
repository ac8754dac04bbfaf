//! Copy-on-write clones of directory trees: what a sticky-disk mount is
//! made of (spec/cache.md §4.4, "Reflink files ... Fallback on filesystems
//! without reflink: sparse copy").
//!
//! [`clone_tree`] walks a generation and recreates it under a new
//! directory: each regular file is a reflink (`FICLONE`) of its source
//! where the filesystem shares extents (XFS with `reflink=1`, btrfs), so it
//! costs a few metadata writes whatever the file's size; elsewhere (ext4)
//! it is a sparse copy that copies only the source's data extents
//! (`SEEK_DATA`/`SEEK_HOLE`, then `copy_file_range`), so a hole stays a
//! hole. Directories, symbolic links, modes and modification times are
//! kept; owners too when the node runs as root. Sockets, FIFOs and device
//! nodes are skipped: a build cache has no use for them.

use std::fs::{self, File, FileTimes, OpenOptions};
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU8, Ordering};

use rustix::fs::SeekFrom;

/// How a tree was cloned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneMethod {
    /// Every regular file is a reflink of its source: O(files), whatever
    /// their sizes.
    Reflink,
    /// At least one file was copied (sparse): O(bytes of data).
    Copy,
}

/// Whether the cache's filesystem shares extents, learnt from the first
/// clone and kept: unknown, yes or no.
#[derive(Debug, Default)]
pub struct ReflinkSupport(AtomicU8);

const YES: u8 = 1;
const NO: u8 = 2;

impl ReflinkSupport {
    /// `Some(true)` once a reflink worked, `Some(false)` once the
    /// filesystem refused one, `None` before either.
    pub(crate) fn known(&self) -> Option<bool> {
        match self.0.load(Ordering::Relaxed) {
            YES => Some(true),
            NO => Some(false),
            _ => None,
        }
    }
}

/// The file system a cache directory is on and whether it shares extents,
/// as [`probe`] found them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filesystem {
    /// Its kind by `statfs(2)`'s magic: `xfs`, `btrfs`, `ext4` (ext2/3/4
    /// share one magic), `tmpfs`, `overlayfs`, `zfs`, or `0x<hex>`.
    pub kind: String,
    /// Whether a `FICLONE` of one file to another in the directory worked.
    pub reflink: bool,
}

impl Filesystem {
    /// How a mount is made on it.
    #[must_use]
    pub fn method(&self) -> CloneMethod {
        if self.reflink {
            CloneMethod::Reflink
        } else {
            CloneMethod::Copy
        }
    }
}

impl CloneMethod {
    /// `reflink` or `copy`, as logs, `billet check` and `billet node status`
    /// say it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reflink => "reflink",
            Self::Copy => "copy",
        }
    }
}

/// The kind of file system `path` is on, by `statfs(2)`'s magic number.
///
/// # Errors
///
/// `statfs` failed (no such path).
pub fn filesystem_kind(path: &Path) -> io::Result<String> {
    let magic = u64::try_from(rustix::fs::statfs(path)?.f_type).unwrap_or(0);
    Ok(match magic {
        0x5846_5342 => "xfs".to_owned(),
        0x9123_683e => "btrfs".to_owned(),
        0xef53 => "ext4".to_owned(),
        0x0102_1994 => "tmpfs".to_owned(),
        0x794c_7630 => "overlayfs".to_owned(),
        0x2fc1_2fc1 => "zfs".to_owned(),
        other => format!("{other:#x}"),
    })
}

/// Finds out what `dir`'s file system is and whether it shares extents:
/// two files are made in `dir`, one with 4 KiB of data, the other a
/// `FICLONE` of it, and both removed. `support` learns the answer, so the
/// first mount does not have to.
///
/// # Errors
///
/// `dir` cannot be written (the files cannot be made).
pub(crate) fn probe(dir: &Path, support: &ReflinkSupport) -> io::Result<Filesystem> {
    let kind = filesystem_kind(dir)?;
    let stem = format!(".reflink-probe-{}", std::process::id());
    let (a, b) = (dir.join(format!("{stem}-a")), dir.join(format!("{stem}-b")));
    let made = (|| {
        let mut source = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&a)?;
        io::Write::write_all(&mut source, &[0x5a; 4096])?;
        source.sync_all()?;
        let target = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&b)?;
        Ok::<_, io::Error>(rustix::fs::ioctl_ficlone(&target, &source).is_ok())
    })();
    let _ = fs::remove_file(&a);
    let _ = fs::remove_file(&b);
    let reflink = made?;
    support
        .0
        .store(if reflink { YES } else { NO }, Ordering::Relaxed);
    Ok(Filesystem { kind, reflink })
}

/// What [`clone_tree`] made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cloned {
    /// Regular files cloned.
    pub files: u64,
    /// Their apparent size, in bytes.
    pub bytes: u64,
    /// How.
    pub method: CloneMethod,
}

/// Recreates the tree at `src` as the new directory `dst` (which must not
/// exist), reflinking each regular file where `support` allows and copying
/// it sparsely otherwise.
///
/// The tree may be a guest's live mount, which the guest can change while
/// it is read (a commit asked in the middle of a job), and the node runs as
/// root: every entry is reached through `walk`, by its parent's
/// descriptor and never through a symbolic link, so a directory swapped for
/// a link to the host mid-walk is refused, not followed.
///
/// # Errors
///
/// The first I/O error, or an entry that changed kind while it was read;
/// `dst` may then hold part of the tree, which the caller removes.
pub fn clone_tree(src: &Path, dst: &Path, support: &ReflinkSupport) -> io::Result<Cloned> {
    let mut made = Cloned {
        files: 0,
        bytes: 0,
        method: CloneMethod::Reflink,
    };
    walk(src, |step| {
        match step {
            Step::Enter { rel, .. } => fs::create_dir(dst.join(rel))?,
            Step::Leave { rel, meta } => keep_attributes(&dst.join(rel), &meta)?,
            Step::File { rel, file, meta } => {
                let to = dst.join(rel);
                if !clone_file(&file, &to, &meta, support)? {
                    made.method = CloneMethod::Copy;
                }
                made.files += 1;
                made.bytes += meta.len();
                keep_attributes(&to, &meta)?;
            }
            Step::Symlink { rel, target, stat } => {
                let to = dst.join(rel);
                std::os::unix::fs::symlink(target, &to)?;
                if rustix::process::geteuid().is_root() {
                    let _ = std::os::unix::fs::lchown(&to, Some(stat.st_uid), Some(stat.st_gid));
                }
            }
            Step::Other { .. } => {}
        }
        Ok(())
    })?;
    Ok(made)
}

/// One entry of a tree [`walk`] reads; `rel` is its path under the root
/// (empty for the root itself).
enum Step<'a> {
    /// A directory, before its entries.
    Enter { rel: &'a Path },
    /// A directory, after its entries, with what its descriptor says of it.
    Leave { rel: &'a Path, meta: fs::Metadata },
    /// A regular file, open for reading, with what its descriptor says.
    File {
        rel: &'a Path,
        file: File,
        meta: fs::Metadata,
    },
    /// A symbolic link (never followed): its target and its own status.
    Symlink {
        rel: &'a Path,
        target: std::ffi::OsString,
        stat: rustix::fs::Stat,
    },
    /// A socket, FIFO or device node (not opened), with its own status.
    Other { stat: rustix::fs::Stat },
}

/// What [`walk`] still has to visit.
enum Pending {
    /// `name` in the directory open as `parent`, to be opened.
    Entry {
        parent: std::rc::Rc<rustix::fd::OwnedFd>,
        name: std::ffi::CString,
        rel: std::path::PathBuf,
    },
    /// A directory whose entries have all been visited.
    Leave {
        rel: std::path::PathBuf,
        meta: fs::Metadata,
    },
}

/// Visits the tree at `root` depth first, directories before and after
/// their entries, without following a symbolic link anywhere below the
/// root and without recursion (a guest may nest directories as deep as it
/// likes). Each entry is opened relative to its parent directory's
/// descriptor with `O_NOFOLLOW` (directories also `O_DIRECTORY`, files
/// also `O_NONBLOCK`), and what is reported of it is what its descriptor
/// says (`fstat`), not what its path said a moment earlier: a guest that
/// swaps an entry for a symbolic link, or a file for a FIFO, while the
/// walk runs gets an error, never a read of what the link points to. At
/// most one descriptor per level of the path being visited is open.
///
/// # Errors
///
/// The first I/O error, an error of `visit`, or an entry that changed
/// kind between being listed and being opened.
fn walk(root: &Path, mut visit: impl FnMut(Step<'_>) -> io::Result<()>) -> io::Result<()> {
    use rustix::fs::{AtFlags, FileType, Mode, OFlags};
    let changed = |rel: &Path| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} changed while it was read", rel.display()),
        )
    };
    let open_dir = |parent: &rustix::fd::OwnedFd, name: &std::ffi::CStr| {
        rustix::fs::openat(
            parent,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let root_fd = rustix::fs::openat(
        rustix::fs::CWD,
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!(
                "{} is not a directory that can be read: {e}",
                root.display()
            ),
        )
    })?;
    let mut stack = Vec::new();
    let mut dir = Some((root_fd, std::path::PathBuf::new()));
    loop {
        if let Some((fd, rel)) = dir.take() {
            // A directory just opened: entered, its entries queued (in
            // reverse, so they are visited in the order they were read),
            // then left once they are done.
            let meta = File::from(fd.try_clone()?).metadata()?;
            visit(Step::Enter { rel: &rel })?;
            stack.push(Pending::Leave {
                rel: rel.clone(),
                meta,
            });
            let parent = std::rc::Rc::new(fd);
            let mut entries = Vec::new();
            for entry in rustix::fs::Dir::read_from(&*parent)? {
                let entry = entry?;
                let name = entry.file_name();
                if name == c"." || name == c".." {
                    continue;
                }
                let child = rel.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
                entries.push(Pending::Entry {
                    parent: std::rc::Rc::clone(&parent),
                    name: name.to_owned(),
                    rel: child,
                });
            }
            stack.extend(entries.into_iter().rev());
        }
        let Some(next) = stack.pop() else {
            return Ok(());
        };
        match next {
            Pending::Leave { rel, meta } => visit(Step::Leave { rel: &rel, meta })?,
            Pending::Entry { parent, name, rel } => {
                let stat = rustix::fs::statat(&*parent, &name, AtFlags::SYMLINK_NOFOLLOW)?;
                match FileType::from_raw_mode(stat.st_mode) {
                    FileType::Directory => {
                        let fd = open_dir(&parent, &name).map_err(|_| changed(&rel))?;
                        dir = Some((fd, rel));
                    }
                    FileType::RegularFile => {
                        let fd = rustix::fs::openat(
                            &*parent,
                            &name,
                            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(|_| changed(&rel))?;
                        let file = File::from(fd);
                        let meta = file.metadata()?;
                        if !meta.is_file() {
                            return Err(changed(&rel));
                        }
                        visit(Step::File {
                            rel: &rel,
                            file,
                            meta,
                        })?;
                    }
                    FileType::Symlink => {
                        let target = rustix::fs::readlinkat(&*parent, &name, Vec::new())?;
                        visit(Step::Symlink {
                            rel: &rel,
                            target: std::ffi::OsString::from_vec(target.into_bytes()),
                            stat,
                        })?;
                    }
                    _ => visit(Step::Other { stat })?,
                }
            }
        }
    }
}

/// Clones one regular file; true when it is a reflink.
fn clone_file(
    source: &File,
    to: &Path,
    meta: &fs::Metadata,
    support: &ReflinkSupport,
) -> io::Result<bool> {
    let target = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)?;
    if support.known() != Some(false) {
        match rustix::fs::ioctl_ficlone(&target, source) {
            Ok(()) => {
                support.0.store(YES, Ordering::Relaxed);
                return Ok(true);
            }
            Err(e)
                if [
                    rustix::io::Errno::OPNOTSUPP,
                    rustix::io::Errno::XDEV,
                    rustix::io::Errno::INVAL,
                    rustix::io::Errno::NOTTY,
                    rustix::io::Errno::NOSYS,
                ]
                .contains(&e) =>
            {
                // This filesystem does not share extents (ext4, tmpfs,
                // overlayfs): never asked again.
                support.0.store(NO, Ordering::Relaxed);
            }
            Err(e) => return Err(e.into()),
        }
    }
    sparse_copy(source, &target, meta.len())?;
    Ok(false)
}

/// Copies the data extents of `source` into `target` at the same offsets
/// and sets its length, so holes stay holes.
///
/// # Errors
///
/// The first read, seek or write that fails.
pub(crate) fn sparse_copy(source: &File, target: &File, len: u64) -> io::Result<()> {
    let mut at = 0u64;
    while at < len {
        let data = match rustix::fs::seek(source, SeekFrom::Data(at)) {
            Ok(offset) => offset,
            // No data past `at`: the rest is a hole.
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = rustix::fs::seek(source, SeekFrom::Hole(data))?.min(len);
        let mut from = data;
        let mut to = data;
        while from < hole {
            let want = usize::try_from(hole - from).unwrap_or(usize::MAX);
            let copied =
                rustix::fs::copy_file_range(source, Some(&mut from), target, Some(&mut to), want)?;
            if copied == 0 {
                // The source shrank under us: what is left reads as zeros.
                break;
            }
        }
        at = hole;
    }
    target.set_len(len)?;
    Ok(())
}

/// Gives `path` the mode, times and (as root) owner of `meta`.
fn keep_attributes(path: &Path, meta: &fs::Metadata) -> io::Result<()> {
    keep_owner(path, meta);
    fs::set_permissions(path, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    let times = FileTimes::new()
        .set_accessed(meta.accessed()?)
        .set_modified(meta.modified()?);
    File::open(path)?.set_times(times)
}

/// Gives `path` the owner of `meta` when that differs from ours; a node
/// that is not root cannot, and the clone is then its own.
fn keep_owner(path: &Path, meta: &fs::Metadata) {
    if rustix::process::geteuid().is_root() {
        let _ = std::os::unix::fs::lchown(path, Some(meta.uid()), Some(meta.gid()));
    }
}

/// Bytes a tree holds on the disk (allocated blocks, so holes are free;
/// extents a reflink shares are counted once per file). Read as
/// [`clone_tree`] reads: through `walk`, never following a link.
///
/// # Errors
///
/// The first directory or file that cannot be read.
pub(crate) fn tree_bytes(path: &Path) -> io::Result<u64> {
    let mut total = 0;
    walk(path, |step| {
        total += match step {
            Step::Enter { .. } => 0,
            Step::Leave { meta, .. } | Step::File { meta, .. } => meta.blocks() * 512,
            Step::Symlink { stat, .. } | Step::Other { stat } => {
                u64::try_from(stat.st_blocks).unwrap_or(0) * 512
            }
        };
        Ok(())
    })?;
    Ok(total)
}

/// The apparent size of the regular files in a tree, in bytes (what
/// [`Cloned::bytes`] counts for a clone of it): holes count, shared extents
/// count once per file. Symbolic links are not followed (`walk`).
///
/// # Errors
///
/// The first directory or file that cannot be read.
pub(crate) fn apparent_bytes(path: &Path) -> io::Result<u64> {
    let mut total = 0;
    walk(path, |step| {
        if let Step::File { meta, .. } = step {
            total += meta.len();
        }
        Ok(())
    })?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, Write};
    use std::os::unix::fs::FileExt;

    fn dir() -> crate::cache::Scratch {
        crate::cache::Scratch::new("billet-clone")
    }

    #[test]
    fn a_cloned_tree_has_the_same_files_links_modes_and_times_and_is_independent() {
        let d = dir();
        let src = d.join("src");
        fs::create_dir_all(src.join("a/b")).unwrap();
        fs::write(src.join("a/b/file"), b"hello").unwrap();
        fs::write(src.join("top"), b"top").unwrap();
        fs::set_permissions(src.join("top"), fs::Permissions::from_mode(0o751)).unwrap();
        std::os::unix::fs::symlink("a/b/file", src.join("link")).unwrap();
        let old = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000);
        File::options()
            .write(true)
            .open(src.join("top"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        let dst = d.join("dst");
        let made = clone_tree(&src, &dst, &ReflinkSupport::default()).unwrap();
        assert_eq!((made.files, made.bytes), (2, 8));
        assert_eq!(fs::read(dst.join("a/b/file")).unwrap(), b"hello");
        assert_eq!(
            fs::read_link(dst.join("link")).unwrap(),
            Path::new("a/b/file")
        );
        let top = fs::metadata(dst.join("top")).unwrap();
        assert_eq!(top.mode() & 0o777, 0o751);
        assert_eq!(top.modified().unwrap(), old);
        // Writing the clone leaves the source as it was.
        fs::write(dst.join("a/b/file"), b"changed").unwrap();
        assert_eq!(fs::read(src.join("a/b/file")).unwrap(), b"hello");
        // The destination must be new.
        assert!(clone_tree(&src, &dst, &ReflinkSupport::default()).is_err());
    }

    /// A guest may swap a directory of its mount for a symbolic link to a
    /// host directory while a commit clones it (`renameat2(RENAME_EXCHANGE)`,
    /// one way, over and over) to have the node, as root, publish the host's
    /// files in the generation. Whatever the swaps, no clone may hold a byte
    /// of what the link points to: the clone is refused, or holds the guest's
    /// files, or the link itself.
    #[test]
    fn a_directory_swapped_for_a_link_to_outside_while_it_is_cloned_is_never_followed() {
        use std::sync::Arc;
        use std::sync::atomic::AtomicBool;
        let d = dir();
        let src = d.join("src");
        let outside = d.join("outside");
        fs::create_dir_all(src.join("a")).unwrap();
        fs::create_dir_all(&outside).unwrap();
        for i in 0..2000 {
            fs::write(src.join(format!("a/x{i}")), b"guest").unwrap();
            fs::write(outside.join(format!("x{i}")), b"SECRET").unwrap();
        }
        std::os::unix::fs::symlink(&outside, src.join("a.lnk")).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let swapper = {
            let (stop, a, link) = (Arc::clone(&stop), src.join("a"), src.join("a.lnk"));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    rustix::fs::renameat_with(
                        rustix::fs::CWD,
                        &a,
                        rustix::fs::CWD,
                        &link,
                        rustix::fs::RenameFlags::EXCHANGE,
                    )
                    .unwrap();
                }
            })
        };
        let mut leaked = Vec::new();
        for round in 0..20 {
            let dst = d.join(format!("dst{round}"));
            let _ = clone_tree(&src, &dst, &ReflinkSupport::default());
            let _ = apparent_bytes(&src);
            let mut dirs = vec![dst];
            while let Some(dir) = dirs.pop() {
                let Ok(entries) = fs::read_dir(&dir) else {
                    continue;
                };
                for entry in entries.flatten() {
                    let kind = entry.file_type().unwrap();
                    if kind.is_dir() {
                        dirs.push(entry.path());
                    } else if kind.is_file() && fs::read(entry.path()).unwrap() == b"SECRET" {
                        leaked.push(entry.path());
                    }
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        swapper.join().unwrap();
        assert!(
            leaked.is_empty(),
            "{} files of the linked directory were cloned, such as {:?}",
            leaked.len(),
            leaked.first()
        );
    }

    /// A guest nesting directories as deep as a path allows would
    /// overflow the debug build's stack in a recursive walk.
    #[test]
    fn a_tree_nested_as_deep_as_a_path_allows_is_cloned_and_measured_without_recursion() {
        let d = dir();
        let src = d.join("src");
        fs::create_dir(&src).unwrap();
        // Made and read relative to each level (no path is that long).
        let mut at = rustix::fs::openat(
            rustix::fs::CWD,
            &src,
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        for _ in 0..1500 {
            rustix::fs::mkdirat(&at, "a", rustix::fs::Mode::from_raw_mode(0o755)).unwrap();
            at = rustix::fs::openat(
                &at,
                "a",
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
                rustix::fs::Mode::empty(),
            )
            .unwrap();
        }
        let file = rustix::fs::openat(
            &at,
            "deepest",
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::CREATE,
            rustix::fs::Mode::from_raw_mode(0o644),
        )
        .unwrap();
        rustix::io::write(&file, b"bottom").unwrap();
        // A thread with a small stack, as a runtime worker's.
        let made = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                let cloned = clone_tree(&src, &d.join("dst"), &ReflinkSupport::default())?;
                Ok::<_, io::Error>((cloned, apparent_bytes(&src)?, tree_bytes(&src)?))
            })
            .unwrap()
            .join()
            .expect("the walk overflowed its stack")
            .unwrap();
        assert_eq!((made.0.files, made.0.bytes, made.1), (1, 6, 6));
        assert!(made.2 > 0);
    }

    #[test]
    fn a_clone_on_a_filesystem_without_reflinks_is_a_sparse_copy_that_keeps_its_holes() {
        let d = dir();
        let src = d.join("src");
        fs::create_dir(&src).unwrap();
        // 64 MiB apparent, 8 KiB of data at each end.
        let mut f = File::create(src.join("sparse")).unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_at(&[9u8; 8192], (64 << 20) - 8192).unwrap();
        f.rewind().unwrap();
        drop(f);
        let support = ReflinkSupport::default();
        let made = clone_tree(&src, &d.join("dst"), &support).unwrap();
        let supported = support.known().expect("the first clone learns it");
        assert_eq!(
            made.method,
            if supported {
                CloneMethod::Reflink
            } else {
                CloneMethod::Copy
            }
        );
        let copy = d.join("dst/sparse");
        let meta = fs::metadata(&copy).unwrap();
        assert_eq!(meta.len(), 64 << 20);
        assert!(
            meta.blocks() * 512 < 1 << 20,
            "the holes were written: {} bytes allocated",
            meta.blocks() * 512
        );
        let bytes = fs::read(&copy).unwrap();
        assert!(bytes[..8192].iter().all(|b| *b == 7));
        assert!(bytes[8192..(64 << 20) - 8192].iter().all(|b| *b == 0));
        assert!(bytes[(64 << 20) - 8192..].iter().all(|b| *b == 9));
        assert!(tree_bytes(&d.join("dst")).unwrap() < 1 << 20);
    }
}
