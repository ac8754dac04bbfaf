//! Documentation generated from the clap definitions, so it cannot drift
//! from the flags: `billet completions SHELL` (clap_complete) and `billet
//! man` (clap_mangen), both to stdout. A package installs their output.

use std::io::Write;
use std::process::ExitCode;

use super::Cli;

/// Writes the completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) -> ExitCode {
    let mut command = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut command, "billet", &mut std::io::stdout());
    ExitCode::SUCCESS
}

/// Writes the man page, `billet(1)`, with one section per subcommand.
pub fn man() -> ExitCode {
    let command = <Cli as clap::CommandFactory>::command();
    match render(&command) {
        Ok(page) => match std::io::stdout().write_all(&page) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::from(super::exit::SERVE),
        },
        Err(e) => {
            eprintln!("error: cannot render the man page: {e}");
            ExitCode::from(super::exit::SERVE)
        }
    }
}

/// The man page's roff: the top-level page, then each subcommand's.
///
/// # Errors
///
/// Writing to the buffer failed.
pub(crate) fn render(command: &clap::Command) -> std::io::Result<Vec<u8>> {
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone()).render(&mut page)?;
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        // Leaked: one short string per subcommand, once per `billet man`.
        let name: &'static str = Box::leak(format!("billet-{}", sub.get_name()).into_boxed_str());
        clap_mangen::Man::new(sub.clone().name(name)).render(&mut page)?;
    }
    Ok(page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_man_page_documents_every_subcommand_and_the_nodes_flags() {
        let command = <Cli as clap::CommandFactory>::command();
        let page = String::from_utf8(render(&command).unwrap()).unwrap();
        assert!(
            page.starts_with(".ie") || page.contains(".TH billet"),
            "{page}"
        );
        for needle in [
            "billet\\-node",
            "billet\\-check",
            "\\-\\-metrics\\-listen",
            "\\-\\-state\\-dir",
        ] {
            assert!(page.contains(needle), "the man page lacks {needle}");
        }
    }

    #[test]
    fn the_bash_completions_offer_the_subcommands_and_flags() {
        let mut command = <Cli as clap::CommandFactory>::command();
        let mut script = Vec::new();
        clap_complete::generate(
            clap_complete::Shell::Bash,
            &mut command,
            "billet",
            &mut script,
        );
        let script = String::from_utf8(script).unwrap();
        for needle in [
            "node",
            "check",
            "--metrics-listen",
            "--state-dir",
            "host-upgrade",
        ] {
            assert!(script.contains(needle), "the completions lack {needle}");
        }
    }

    #[test]
    fn the_version_line_is_the_version_then_the_commit_and_the_updater_reads_the_version() {
        let line = format!("billet {}\n", super::super::version_line());
        assert!(line.contains("(commit "), "{line}");
        assert_eq!(
            crate::upgrade::updater::parse_version_line(&line),
            Some(crate::upgrade::version::version())
        );
        assert_eq!(
            crate::upgrade::updater::parse_version_line("billet 1.2.3\n"),
            Some("1.2.3")
        );
        assert_eq!(
            crate::upgrade::updater::parse_version_line("other 1.2.3"),
            None
        );
    }
}
