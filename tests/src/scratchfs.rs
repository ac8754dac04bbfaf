//! File systems a test or benchmark mounts for itself and unmounts however
//! it ends: a small tmpfs to fill (a node's state or cache directory on a
//! full disk), and a loop-mounted XFS made with `reflink=1` (what the
//! node-local cache's mounts are cheap on; this machine's own disks are
//! ext4). Both need root; XFS needs `mkfs.xfs` (Debian's `xfsprogs`, in
//! `scripts/test`'s `need` table).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// A mounted scratch file system, unmounted (and its image removed) on
/// drop.
#[derive(Debug)]
pub struct ScratchFs {
    /// Where it is mounted.
    pub path: PathBuf,
    /// The image file behind a loop mount.
    image: Option<PathBuf>,
}

fn run(command: &mut Command, what: &str) -> Result<()> {
    let out = command.output().with_context(|| format!("run {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed (this needs root{}): {}",
            if what.starts_with("mkfs.xfs") {
                " and xfsprogs"
            } else {
                ""
            },
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl ScratchFs {
    /// A tmpfs of `size_mib` MiB, mode 0700.
    ///
    /// # Errors
    ///
    /// When it cannot be mounted (not root).
    pub fn tmpfs(size_mib: u64) -> Result<Self> {
        let path = crate::cluster::scratch_dir("small-fs")?;
        run(
            Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size_mib}m,mode=0700")])
                .arg("tmpfs")
                .arg(&path),
            &format!("mount a {size_mib} MiB tmpfs at {}", path.display()),
        )?;
        Ok(Self { path, image: None })
    }

    /// An XFS with reflinks (`mkfs.xfs -m reflink=1`) on a sparse image of
    /// `size_gib` GiB in `beside` (which must have room for what is
    /// written), loop-mounted.
    ///
    /// # Errors
    ///
    /// When `mkfs.xfs` is missing or the image cannot be mounted (not
    /// root, no loop devices).
    pub fn xfs_reflink(beside: &Path, size_gib: u64) -> Result<Self> {
        let path = crate::cluster::scratch_dir("xfs")?;
        let image = beside.join(format!("billet-xfs-{}.img", uuid::Uuid::new_v4().simple()));
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(size_gib << 30))
            .with_context(|| format!("make the image {}", image.display()))?;
        let fs = Self {
            path,
            image: Some(image.clone()),
        };
        run(
            Command::new("mkfs.xfs")
                .args(["-q", "-m", "reflink=1"])
                .arg(&image),
            &format!("mkfs.xfs -m reflink=1 {}", image.display()),
        )?;
        run(
            Command::new("mount")
                .args(["-o", "loop"])
                .arg(&image)
                .arg(&fs.path),
            &format!("mount -o loop {} {}", image.display(), fs.path.display()),
        )?;
        Ok(fs)
    }

    /// Writes `name` until the file system is full; its path.
    ///
    /// # Errors
    ///
    /// A write that fails otherwise than for want of space.
    pub fn fill(&self, name: &str) -> Result<PathBuf> {
        use std::io::Write as _;
        let file = self.path.join(name);
        let mut f = std::fs::File::create(&file)?;
        let chunk = vec![0xa5u8; 1 << 20];
        loop {
            match f.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                Err(e) => return Err(e).context("fill"),
            }
        }
        // What is left is less than a chunk: fill it byte-sized.
        while f.write_all(&[0xa5; 512]).is_ok() {}
        Ok(file)
    }
}

impl Drop for ScratchFs {
    fn drop(&mut self) {
        // Lazy: a process still holding a file there does not keep it
        // mounted; a loop mount's device is released with it (autoclear).
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        let _ = std::fs::remove_dir(&self.path);
        if let Some(image) = &self.image {
            let _ = std::fs::remove_file(image);
        }
    }
}
