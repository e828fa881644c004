//! The README's claims that a CPU can check (the commands in its code blocks are checked as
//! symm-bench flags by symm-bench's own tests, `args::tests::documented_commands_parse`):
//! every relative link and anchor resolves, the `Config` table lists exactly `Config`'s
//! fields, and every environment variable of its table is read somewhere in the code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Pages the README links to that other parts of the project write; an entry is removed
/// once its page exists (the test then checks it like any other link).
const WRITTEN_ELSEWHERE: &[&str] = &[];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The text outside fenced code blocks.
fn prose(md: &str) -> String {
    let mut out = String::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Link targets `[text](target)` of the prose.
fn links(md: &str) -> Vec<String> {
    let text = prose(md);
    let mut found = Vec::new();
    let mut rest = text.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        if let Some(end) = rest.find(')') {
            found.push(rest[..end].to_string());
        }
    }
    found
}

/// GitHub's anchor of a heading: lower case, spaces to `-`, punctuation dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(md: &str) -> BTreeSet<String> {
    prose(md)
        .lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect()
}

/// Every relative link of `file` (a path from the root): its file exists, and its anchor
/// is a heading of that file when the target is Markdown.
fn check_links(file: &str, problems: &mut Vec<String>) -> usize {
    let dir = Path::new(file).parent().unwrap_or(Path::new(""));
    let mut checked = 0;
    for target in links(&read(file)) {
        if target.starts_with("http://") || target.starts_with("https://") || target.starts_with("mailto:") {
            continue;
        }
        checked += 1;
        let (path, frag) = target.split_once('#').unwrap_or((target.as_str(), ""));
        let resolved: PathBuf = if path.is_empty() {
            PathBuf::from(file)
        } else {
            dir.join(path)
        };
        let rel = normalize(&resolved);
        if !root().join(&rel).exists() {
            if !WRITTEN_ELSEWHERE.contains(&rel.as_str()) {
                problems.push(format!("{file}: link to {target}: {rel} does not exist"));
            }
            continue;
        }
        if !frag.is_empty() && rel.ends_with(".md") && !anchors(&read(&rel)).contains(frag) {
            problems.push(format!("{file}: link to {target}: no heading #{frag} in {rel}"));
        }
    }
    checked
}

/// `a/b/../c` → `a/c`, with `/` separators.
fn normalize(p: &Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            _ => {}
        }
    }
    parts.join("/")
}

#[test]
fn links_and_anchors_resolve() {
    let mut problems = Vec::new();
    let mut checked = check_links("README.md", &mut problems);
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            checked += check_links(&format!("docs/{name}"), &mut problems);
        }
    }
    checked += check_links("docs/bench/README.md", &mut problems);
    checked += check_links("CHANGELOG.md", &mut problems);
    checked += check_links("symm-bench/README.md", &mut problems);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(checked >= 30, "only {checked} links checked: the scan is broken");
    for page in WRITTEN_ELSEWHERE {
        if root().join(page).exists() {
            println!("{page} exists now: remove it from WRITTEN_ELSEWHERE");
        }
    }
}

#[test]
fn the_link_checker_sees_broken_links() {
    assert_eq!(
        links("a [x](b.md#c) `[y](z)`\n```\n[q](no.md)\n```\n"),
        ["b.md#c", "z"]
    );
    assert_eq!(
        anchor(" Using it from candle / mistral.rs"),
        "using-it-from-candle--mistralrs"
    );
    assert_eq!(anchor("Install"), "install");
    let mut problems = Vec::new();
    let tmp = "target/readme-test-links.md";
    std::fs::create_dir_all(root().join("target")).unwrap();
    std::fs::write(
        root().join(tmp),
        "[a](../README.md#install) [b](../nope.md) [c](#missing)\n# Here\n",
    )
    .unwrap();
    check_links(tmp, &mut problems);
    std::fs::remove_file(root().join(tmp)).unwrap();
    assert_eq!(problems.len(), 2, "{problems:?}");
}

/// The rows of the first table after `heading`, first column, backticks removed.
fn table_column(md: &str, heading: &str) -> Vec<String> {
    let start = md.find(heading).unwrap_or_else(|| panic!("no {heading:?}"));
    md[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .filter_map(|l| l.split('|').nth(1))
        .map(|c| c.trim().to_string())
        .collect()
}

#[test]
fn the_config_table_lists_every_field() {
    let src = read("src/config.rs");
    let body = &src[src.find("pub struct Config {").expect("Config in src/config.rs")..];
    let body = &body[..body.find("\n}").unwrap()];
    let fields: BTreeSet<String> = body
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().strip_prefix("pub "))
        .filter_map(|l| l.split(':').next())
        .map(str::to_string)
        .collect();
    let readme: BTreeSet<String> = table_column(&read("README.md"), "`Config` (the defaults")
        .into_iter()
        .map(|c| c.trim_matches('`').to_string())
        .collect();
    assert!(fields.len() >= 14, "{fields:?}");
    assert_eq!(readme, fields, "README's Config table against Config's fields");
}

#[test]
fn every_environment_variable_named_is_read_by_the_code() {
    let mut code = read("build.rs");
    for dir in ["src", "tests/common", "symm-bench/src"] {
        let mut stack = vec![root().join(dir)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    code += &std::fs::read_to_string(&p).unwrap();
                }
            }
        }
    }
    let mut names = Vec::new();
    for cell in table_column(&read("README.md"), "## Environment variables") {
        for part in cell.split('`') {
            let name = part.split('=').next().unwrap_or("");
            if name.len() > 2
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                names.push(name.to_string());
            }
        }
    }
    assert!(names.len() >= 15, "{names:?}");
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !code.contains(&format!("\"{n}\"")))
        .collect();
    assert!(
        missing.is_empty(),
        "named in the README but read nowhere: {missing:?}"
    );
}
