//! A sticky disk's work: the counter incremented, and the disk filled when asked.

/// Increments the decimal counter in `path` (a missing file counts 0), saying so on stderr; a
/// file that cannot be read, parsed or written is said, and nothing else happens: a cache never
/// fails a job.
pub(crate) fn count(path: &std::path::Path) {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(n) => n,
            Err(e) => {
                eprintln!(
                    "billet-standin-runner: sticky counter {}: not a number: {e}",
                    path.display()
                );
                return;
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => {
            eprintln!(
                "billet-standin-runner: sticky counter {}: {e}",
                path.display()
            );
            return;
        }
    };
    let new = old + 1;
    match std::fs::write(path, format!("{new}\n")) {
        Ok(()) => eprintln!(
            "billet-standin-runner: sticky counter {}: {old} -> {new}",
            path.display()
        ),
        Err(e) => eprintln!(
            "billet-standin-runner: sticky counter {}: {e}",
            path.display()
        ),
    }
}

/// Writes `fill` beside `counter` until its disk is full, saying how much on stderr; any other
/// failure is said and the job goes on.
pub(crate) fn fill_beside(counter: &std::path::Path) {
    use std::io::Write as _;
    let path = counter.with_file_name("fill");
    let mut written = 0u64;
    let outcome = std::fs::File::create(&path).and_then(|mut f| {
        let chunk = vec![0xa5u8; 1 << 20];
        loop {
            match f.write(&chunk) {
                Ok(0) => return Ok(()),
                Ok(n) => written += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    match outcome {
        Ok(()) => eprintln!(
            "billet-standin-runner: sticky fill {}: {written} bytes, disk full",
            path.display()
        ),
        Err(e) => eprintln!(
            "billet-standin-runner: sticky fill {}: {e} after {written} bytes",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sticky_counter_counts_from_a_missing_file_and_leaves_a_bad_one_alone() {
        let dir = std::env::temp_dir().join(format!("standin-sticky-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = dir.join("n");
        let _ = std::fs::remove_file(&n);
        count(&n);
        assert_eq!(std::fs::read_to_string(&n).unwrap(), "1\n");
        count(&n);
        assert_eq!(std::fs::read_to_string(&n).unwrap(), "2\n");
        std::fs::write(&n, "two").unwrap();
        count(&n);
        assert_eq!(std::fs::read_to_string(&n).unwrap(), "two");
        // A disk that is not there: said, and nothing else.
        count(&dir.join("missing").join("n"));
    }
}
