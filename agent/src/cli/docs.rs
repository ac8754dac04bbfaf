//! Documentation generated from the clap definitions, so it cannot drift
//! from the flags: `billet completions SHELL` (clap_complete) and `billet
//! man [--dir DIR]` (clap_mangen, one page per command, with ENVIRONMENT
//! from the flags' variables, FILES and EXIT STATUS). A package installs
//! their output.

use std::io::Write;
use std::process::ExitCode;

use super::Cli;

/// Writes the completion script for `shell`.
pub fn completions(shell: clap_complete::Shell) -> ExitCode {
    let mut command = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut command, "billet", &mut std::io::stdout());
    ExitCode::SUCCESS
}

/// Writes the man pages: all of them to stdout, or one `<command>.1`
/// each into `dir`.
pub fn man(dir: Option<&std::path::Path>) -> ExitCode {
    let written = pages().and_then(|pages| match dir {
        None => {
            let mut out = std::io::stdout();
            pages.iter().try_for_each(|(_, page)| out.write_all(page))
        }
        Some(dir) => pages
            .iter()
            .try_for_each(|(name, page)| std::fs::write(dir.join(format!("{name}.1")), page)),
    });
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: cannot write the man pages: {e}");
            ExitCode::from(super::exit::SERVE)
        }
    }
}

/// Every man page, by name: `billet`, each visible subcommand as
/// `billet-<name>`, and `billet node status` and `billet node enroll`,
/// which are parsed on their own.
///
/// # Errors
///
/// Writing to a buffer failed.
pub(crate) fn pages() -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let top = <Cli as clap::CommandFactory>::command();
    let mut commands = vec![("billet".to_owned(), top.clone())];
    for sub in top.get_subcommands().filter(|s| !s.is_hide_set()) {
        commands.push((format!("billet-{}", sub.get_name()), sub.clone()));
    }
    commands.push((
        "billet-node-status".to_owned(),
        <super::status::StatusArgs as clap::CommandFactory>::command(),
    ));
    commands.push((
        "billet-node-enroll".to_owned(),
        <super::enroll::EnrollArgs as clap::CommandFactory>::command(),
    ));
    commands
        .into_iter()
        .map(|(name, command)| {
            let page = render(&name, command)?;
            Ok((name, page))
        })
        .collect()
}

/// One page: clap_mangen's, then ENVIRONMENT (every variable the command
/// reads), FILES and EXIT STATUS.
fn render(name: &str, command: clap::Command) -> std::io::Result<Vec<u8>> {
    // Leaked: one short string per page, once per `billet man`.
    let name: &'static str = Box::leak(name.to_owned().into_boxed_str());
    let command = command.name(name);
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone()).render(&mut page)?;
    page.extend_from_slice(environment(&command).as_bytes());
    page.extend_from_slice(FILES.as_bytes());
    page.extend_from_slice(EXIT_STATUS.as_bytes());
    Ok(page)
}

/// Roff's escapes for text: a backslash and a hyphen (else a typographic
/// dash that cannot be typed or searched for).
fn roff(text: &str) -> String {
    text.replace('\\', "\\e").replace('-', "\\-")
}

fn environment(command: &clap::Command) -> String {
    let mut section = String::from(".SH ENVIRONMENT\n");
    for arg in command.get_arguments() {
        let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
            continue;
        };
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let first = help.split(". ").next().unwrap_or_default();
        section.push_str(&format!(
            ".TP\n\\fB{}\\fR\nAs \\fB\\-\\-{}\\fR: {}\n",
            roff(&env.to_string_lossy()),
            roff(long),
            roff(first.trim_end_matches('.'))
        ));
    }
    section.push_str(
        ".TP\n\\fBBILLET_LOG\\fR\nThe log filter (a tracing filter: \\fBinfo\\fR, \\fBdebug\\fR, \\fBbillet_agent=trace\\fR); \\fBinfo\\fR when unset.\n",
    );
    section
}

const FILES: &str = ".SH FILES
.TP
\\fB/etc/billet/node.env\\fR
The packaged unit's environment: the flags as \\fBBILLET_\\fR variables.
.TP
\\fB/etc/billet/tls/\\fR
The node's certificate, key (mode 0600, or 0640 owned by root) and CA; renewals and enrolments write the new key and certificate here.
.TP
\\fB/var/lib/billet/\\fR
The state directory (\\fB\\-\\-state\\-dir\\fR, mode 0700): \\fBnode.sock\\fR (the local socket \\fBbillet node status\\fR reads), \\fBjournal.db\\fR (the node journal, never recreated silently), \\fBcache/\\fR (the sticky disks and the Actions cache, unless \\fB\\-\\-cache\\-dir\\fR), \\fBupgrade/\\fR (the updater's journal).
";

const EXIT_STATUS: &str = ".SH EXIT STATUS
.TP
\\fB0\\fR
Stopped cleanly on SIGTERM; for \\fBbillet check\\fR, the configuration is usable.
.TP
\\fB1\\fR
The gRPC server failed while serving.
.TP
\\fB2\\fR
A configuration value is invalid (the message names the flag, variable, or file and key).
.TP
\\fB3\\fR
The TLS material cannot be used (the message names the file).
.TP
\\fB4\\fR
An address cannot be bound (the message names the flag).
.TP
\\fB5\\fR
The Docker engine cannot be reached.
.TP
\\fB6\\fR
The state or cache directory cannot be used, another node serves the state directory, or this user may not look at it.
.TP
\\fB7\\fR
The node journal cannot be used.
.TP
\\fB8\\fR
\\fBbillet host\\-upgrade\\fR refused the upgrade.
.TP
\\fB9\\fR
\\fBbillet host\\-upgrade\\fR accepted the upgrade and then failed.
.TP
\\fB10\\fR
\\fBbillet node status\\fR: no node answers on the local socket.
.TP
\\fB101\\fR
A thread or task panicked (a bug).
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn there_is_a_man_page_per_command_each_with_environment_files_and_exit_status() {
        let pages = pages().unwrap();
        let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
        for name in [
            "billet",
            "billet-node",
            "billet-check",
            "billet-node-status",
            "billet-node-enroll",
            "billet-host-upgrade",
        ] {
            assert!(names.contains(&name), "no page {name}: {names:?}");
        }
        for (name, page) in &pages {
            let page = String::from_utf8(page.clone()).unwrap();
            assert!(page.contains(&format!(".TH {name}")), "{name}:\n{page}");
            for section in [".SH ENVIRONMENT", ".SH FILES", ".SH EXIT STATUS"] {
                assert!(page.contains(section), "{name} lacks {section}");
            }
        }
        let node = String::from_utf8(pages[1].1.clone()).unwrap();
        for needle in [
            "\\fBBILLET_METRICS_LISTEN\\fR",
            "\\-\\-metrics\\-listen",
            "\\-\\-state\\-dir",
            "journal.db",
        ] {
            assert!(node.contains(needle), "billet-node lacks {needle}");
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
