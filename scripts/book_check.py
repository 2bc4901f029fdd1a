#!/usr/bin/env python3
"""Checks of the book in docs/ (run by scripts/book.sh after `mdbook build`), standard library only.

- links:    every relative link in the built HTML leads to a page that exists, and its #anchor
            to an element with that id there. Links out (http, https, mailto) are not fetched.
- examples: every ```yaml block of the book's sources (and of README.md) is a whole policy that
            the real `sluice check` accepts. A block meant to be refused says so in its info
            string (```yaml,refused) and must be refused (exit 1 and an `error:` line); a block
            that is not a whole policy says ```yaml,fragment and is only counted. Each example
            is checked in a folder of its own, beside copies of the files in docs/fixtures/
            (the key files an example names).
- files:    every relative link of README.md (and the other --also files) leads to a file.
- schema:   every field of config/sluice.schema.json appears in the policy file's reference
            page as a code span spelled like `routes[].limits[].window` or `upstreams.<name>.url`.
- paths:    every code span of the book's Markdown (and of README.md) that names a repository
            path (`src/limiter/gcra.rs`, `tests/it/faults.rs:12`, `scripts/soak.sh --x`,
            `Cargo.toml`) names one that exists: a span whose first word starts with a
            top-level directory of the repository and a `/`, or is a top-level file. A trailing
            `:line` or `#anchor` is dropped; a missing path with a placeholder in it (`*`, `{`,
            `<`, `...`, `…`, `$`, an upper-case word such as NAME) is not a path and is skipped.
- sections: every comment of src/ that names a section of the README or of the book in quotes
            (`README, "Models"`, `the book's "Adding an algorithm or a limit kind"`) names a
            heading that README.md (for the README) or the book (for the book) has.
- spread:   each algorithm of the table (`label: "..."` in src/limiter/algorithm.rs; not the
            limit kinds `calendar` and `concurrency`, whose request-path code names them) is
            named in at most MAX_ALGORITHM_FILES files of src/ outside tests, as the book's
            "Adding an algorithm or a limit kind" promises: its label in any spelling
            (`sliding_log`, `SlidingLog`, `sliding log`, any case), in each file up to its
            first `#[cfg(test)]`.

Exit status 1 with one line per fault; 0 with a summary line per check.
"""

import argparse
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse

FENCE = re.compile(r"^([ \t]*)(```+|~~~+)[ \t]*([^\n`]*)$")


class Page(html.parser.HTMLParser):
    """The ids an HTML page defines and the links it makes."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids = set()
        self.links = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("id", "name") if tag == "a" else ("id",):
            if attrs.get(name):
                self.ids.add(attrs[name])
        if tag == "a" and attrs.get("href") is not None:
            self.links.append((attrs["href"], self.getpos()[0]))


def check_links(html_root):
    pages = {}
    for folder, _, files in os.walk(html_root):
        for name in files:
            if name.endswith(".html"):
                path = os.path.normpath(os.path.join(folder, name))
                page = Page()
                with open(path, encoding="utf-8") as f:
                    page.feed(f.read())
                pages[path] = page
    faults, checked, outside = [], 0, 0
    for path, page in sorted(pages.items()):
        # The print page repeats every page's links, rewritten; the pages themselves are checked.
        if os.path.basename(path) == "print.html":
            continue
        for href, line in page.links:
            parts = urllib.parse.urlsplit(href)
            if parts.scheme or href.startswith("//"):
                outside += 1
                continue
            if href in ("", "#") or href.startswith("javascript:"):
                continue
            checked += 1
            target = path
            if parts.path:
                target = os.path.normpath(
                    os.path.join(os.path.dirname(path), urllib.parse.unquote(parts.path))
                )
                if os.path.isdir(target):
                    target = os.path.join(target, "index.html")
            where = f"{os.path.relpath(path, html_root)}:{line}"
            if target.endswith(".html"):
                if target not in pages:
                    faults.append(f"{where}: link `{href}`: no page {os.path.relpath(target, html_root)}")
                    continue
                anchor = urllib.parse.unquote(parts.fragment)
                if anchor and anchor not in pages[target].ids:
                    faults.append(
                        f"{where}: link `{href}`: no anchor #{anchor} in "
                        f"{os.path.relpath(target, html_root)}"
                    )
            elif not os.path.exists(target):
                faults.append(f"{where}: link `{href}`: no file {os.path.relpath(target, html_root)}")
    return faults, f"links: {checked} internal links and anchors resolve ({outside} links out, not fetched)"


def check_file_links(paths):
    """Relative links of Markdown files read outside the book (README.md) lead to files that exist."""
    faults, checked = [], 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            parts = urllib.parse.urlsplit(target)
            if parts.scheme or not parts.path:
                continue
            checked += 1
            if not os.path.exists(os.path.join(os.path.dirname(path), parts.path)):
                faults.append(f"{path}: link `{target}`: no file {parts.path}")
    return faults, f"files: {checked} links of {', '.join(paths) or 'no file'} lead to files that exist"


def markdown_lines(text):
    """Walks a Markdown text's lines once, fenced code blocks recognised: yields (number, line,
    block) for every line. `block` is None for a line outside any fenced block, and (opening
    line number, indent, info string) for a line of one, its fences included (given with
    `line` None: a fence is neither prose nor code). A block closes at a line of its fence's
    character, at least as long, and nothing else; one left open runs to the end."""
    block, fence = None, None
    for number, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if block is None:
            if m:
                block, fence = (number, m.group(1), m.group(3).strip()), m.group(2)
                yield number, None, block
            else:
                yield number, line, None
        elif (m and m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence)
              and not m.group(3).strip()):
            yield number, None, block
            block, fence = None, None
        else:
            yield number, line, block


def prose_lines(text):
    """(number, line) of each line of a Markdown text outside its fenced code blocks."""
    return [(number, line) for number, line, block in markdown_lines(text) if block is None]


def fenced_blocks(path):
    """(first line, info string, text) of each fenced code block of a Markdown file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    blocks = {}
    for _, line, block in markdown_lines(text):
        if block is None:
            continue
        body = blocks.setdefault(block, [])
        if line is not None:
            indent = block[1]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
    return [(first, info, "\n".join(body) + "\n") for (first, _, info), body in blocks.items()]


def check_examples(sources, sluice, fixtures):
    faults, whole, refused, fragments = [], 0, 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for n, (path, line, info, text) in enumerate(
            (path, line, info, text)
            for path in sources
            for line, info, text in fenced_blocks(path)
        ):
            words = [w.strip() for w in info.split(",")]
            if words[0] not in ("yaml", "yml"):
                continue
            where = f"{path}:{line}"
            unknown = set(words[1:]) - {"refused", "fragment"}
            if unknown:
                faults.append(f"{where}: unknown marker {sorted(unknown)} (yaml, yaml,refused or yaml,fragment)")
                continue
            if "fragment" in words:
                fragments.append(where)
                continue
            folder = os.path.join(tmp, f"example-{n}")
            if fixtures and os.path.isdir(fixtures):
                shutil.copytree(fixtures, folder)
            else:
                os.makedirs(folder)
            policy = os.path.join(folder, "policy.yaml")
            with open(policy, "w", encoding="utf-8") as f:
                f.write(text)
            run = subprocess.run(
                [sluice, "check", "--config", policy], capture_output=True, text=True, timeout=60
            )
            said = (run.stderr.strip().splitlines() or [""])[-1].replace(policy, "EXAMPLE")
            if "refused" in words:
                refused += 1
                if run.returncode == 1 and "error:" in run.stderr:
                    print(f"{where}: refused as marked: {said}")
                else:
                    faults.append(
                        f"{where}: marked refused, but `sluice check` exited {run.returncode}"
                        f" ({said or run.stdout.strip()})"
                    )
            else:
                whole += 1
                if run.returncode != 0:
                    faults.append(f"{where}: `sluice check` refused it: {said}")
    summary = (
        f"examples: {whole} whole policies accepted and {refused} refused as marked by "
        f"`sluice check`; {len(fragments)} fragments not checked"
        + (f" ({', '.join(fragments)})" if fragments else "")
    )
    return faults, summary


def schema_fields(schema):
    """Every field path of the policy's JSON Schema, spelled as the reference spells it."""
    definitions = schema.get("definitions", {}) | schema.get("$defs", {})

    def resolve(node, seen):
        """The object schemas a node can be (through $ref, anyOf, oneOf, allOf)."""
        if not isinstance(node, dict):
            return []
        ref = node.get("$ref")
        if ref:
            name = ref.rsplit("/", 1)[-1]
            if name in seen:
                return []
            return resolve(definitions[name], seen | {name})
        found = [node]
        for key in ("anyOf", "oneOf", "allOf"):
            for variant in node.get(key, []):
                found += resolve(variant, seen)
        return found

    paths = []

    def walk(node, prefix, seen):
        for variant in resolve(node, seen):
            for name, child in variant.get("properties", {}).items():
                path = f"{prefix}.{name}" if prefix else name
                paths.append(path)
                walk(child, path, seen)
            if isinstance(variant.get("items"), dict):
                walk(variant["items"], prefix + "[]", seen)
            # A map by name: `upstreams.<name>.url`.
            values = list(variant.get("patternProperties", {}).values())
            extra = variant.get("additionalProperties")
            if isinstance(extra, dict) and not variant.get("properties"):
                values.append(extra)
            for value in values:
                paths.append(prefix + ".<name>")
                walk(value, prefix + ".<name>", seen)

    walk(schema, "", frozenset())
    return sorted(set(paths))


def check_schema(schema_path, reference):
    with open(schema_path, encoding="utf-8") as f:
        fields = schema_fields(json.load(f))
    with open(reference, encoding="utf-8") as f:
        spans = set(re.findall(r"`([^`\n]+)`", f.read()))
    missing = [field for field in fields if field not in spans]
    faults = [f"{reference}: the schema's field `{field}` is not in the reference" for field in missing]
    # And the other way: a row of the reference's field table names a field the schema has.
    with open(reference, encoding="utf-8") as f:
        rows = re.findall(r"^\| `([^`]+)` \|", f.read(), re.M)
    faults += [
        f"{reference}: the row `{row}` names no field of the schema (renamed or removed?)"
        for row in rows
        if row not in fields
    ]
    faults += [
        f"{reference}: the field `{row}` has {rows.count(row)} rows"
        for row in sorted(set(rows))
        if rows.count(row) > 1
    ]
    return faults, (
        f"schema: all {len(fields)} fields of {schema_path} are in {reference}, "
        f"and its {len(rows)} field rows are all in the schema"
    )


def repository_entries(root):
    """The repository's top-level directories and files: those git tracks, or, without git,
    what the root holds (build outputs left out)."""
    try:
        run = subprocess.run(
            ["git", "-C", root, "ls-files"], capture_output=True, text=True, timeout=60, check=True
        )
        names = run.stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        names = []
    if names:
        dirs = {name.split("/", 1)[0] for name in names if "/" in name}
        files = {name for name in names if "/" not in name}
        return dirs, files
    dirs, files = set(), set()
    for name in os.listdir(root):
        if name in ("target", ".git"):
            continue
        (dirs if os.path.isdir(os.path.join(root, name)) else files).add(name)
    return dirs, files


PLACEHOLDER = re.compile(r"[*?{}<>\[\]$…|]|\.\.\.|(^|[/._-])[A-Z][A-Z0-9_]+([/._-]|$)")


def code_spans(text):
    """(line, text) of each inline code span of a Markdown text, fenced blocks left out."""
    spans = []
    for number, line in prose_lines(text):
        # A span is delimited by runs of backticks of the same length.
        for m in re.finditer(r"(`+)(.+?)\1(?!`)", line):
            spans.append((number, m.group(2).strip()))
    return spans


def check_paths(sources, root):
    """Code spans naming a repository path name one that exists."""
    dirs, files = repository_entries(root)
    faults, checked = [], 0
    for path in sources:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for line, span in code_spans(text):
            word = span.split()[0] if span.split() else ""
            word = word.rstrip(".,;:)")
            first = word.split("/", 1)[0]
            if not ((first in dirs and "/" in word) or word in files):
                continue
            target = re.sub(r"#.*$", "", word)
            target = re.sub(r":\d+(-\d+)?(:\d+)?$", "", target)
            if os.path.exists(os.path.join(root, target)):
                checked += 1
                continue
            if PLACEHOLDER.search(target):
                continue
            checked += 1
            faults.append(f"{path}:{line}: `{span}`: no file or folder {target} in the repository")
    return faults, f"paths: {checked} repository paths named in code spans exist"


def headings(paths):
    """The headings of Markdown files (any level, fenced blocks left out), normalised."""
    found = set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for _, line in prose_lines(text):
            h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if h:
                found.add(normalise_heading(h.group(1)))
    return found


def normalise_heading(text):
    return " ".join(text.replace("`", "").split()).casefold()


# `README, "Models"`, `README's "Two commands"`, `the book's "Adding an algorithm"`,
# `see README section "…"`: a section named in quotes right after README or the book.
SECTION_CITE = re.compile(r"\b(README(?:\.md)?|book)(?:'s)?(?:,|:)?\s+(?:section\s+|page\s+)?\"([^\"]+)\"")


def check_sections(code_root, readme, book_sources):
    """Comments of the code that cite a section of the README or the book by its heading name
    a heading that exists there."""
    readme_headings, book_headings = headings([readme]), headings(book_sources)
    faults, checked = [], 0
    for folder, _, names in os.walk(code_root):
        for name in sorted(names):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                lines = f.read().split("\n")
            # Runs of comment lines, read as one text (a citation may break across lines).
            runs, run = [], []
            for number, line in enumerate(lines, 1):
                m = re.match(r"^\s*//[/!]?\s?(.*)$", line)
                if m:
                    run.append((number, m.group(1)))
                elif run:
                    runs.append(run)
                    run = []
            if run:
                runs.append(run)
            for run in runs:
                text = " ".join(part for _, part in run)
                for m in SECTION_CITE.finditer(text):
                    checked += 1
                    where, section = m.group(1), m.group(2)
                    known = readme_headings if where.startswith("README") else book_headings
                    if normalise_heading(section) not in known:
                        faults.append(
                            f"{path}:{run[0][0]}: a comment cites the {'README' if known is readme_headings else 'book'}'s "
                            f"section \"{section}\", which has no such heading"
                        )
    return faults, f"sections: {checked} sections of the README or the book cited in {code_root}'s comments exist"


# The files an algorithm is named in: its Rust module, `mod` line (src/limiter/mod.rs), Lua
# file, table row (algorithm.rs), config spelling (config/types.rs) and `Cell` state (local.rs).
MAX_ALGORITHM_FILES = 6
LIMIT_KINDS = {"calendar", "concurrency"}


def check_algorithm_spread(code_root):
    """Each algorithm's label appears in at most MAX_ALGORITHM_FILES files of the code outside
    tests."""
    table = os.path.join(code_root, "limiter", "algorithm.rs")
    with open(table, encoding="utf-8") as f:
        labels = [l for l in re.findall(r'^\s*label: "(\w+)",', f.read(), re.M) if l not in LIMIT_KINDS]
    texts = {}
    for folder, _, names in os.walk(code_root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            texts[path] = text.split("#[cfg(test)]", 1)[0]
    faults, most = [], 0
    for label in labels:
        spelled = re.compile(label.replace("_", "[_ ]?"), re.I)
        files = sorted(path for path, text in texts.items() if spelled.search(text))
        most = max(most, len(files))
        if len(files) > MAX_ALGORITHM_FILES:
            faults.append(
                f"{label} is named in {len(files)} files of {code_root} outside tests (at most "
                f"{MAX_ALGORITHM_FILES}: say what the table says instead): {', '.join(files)}"
            )
    if not labels:
        faults.append(f"{table}: no algorithm labels found")
    return faults, f"spread: {len(labels)} algorithms, each named in at most {most} files of {code_root}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--html", required=True, help="the built book (docs/book)")
    parser.add_argument("--src", required=True, help="the book's Markdown (docs/src)")
    parser.add_argument("--sluice", required=True, help="the sluice binary")
    parser.add_argument("--fixtures", help="files copied beside each example")
    parser.add_argument("--schema", required=True, help="config/sluice.schema.json")
    parser.add_argument("--reference", required=True, help="the policy file's reference page")
    parser.add_argument("--also", nargs="*", default=[], help="more Markdown files with examples")
    parser.add_argument("--root", default=".", help="the repository, for the paths code spans name")
    parser.add_argument("--code", help="source folder whose comments' README/book citations are checked")
    parser.add_argument("--readme", default="README.md", help="the README those comments cite")
    args = parser.parse_args()

    sources = sorted(
        os.path.join(folder, name)
        for folder, _, files in os.walk(args.src)
        for name in files
        if name.endswith(".md")
    ) + args.also
    book_sources = [path for path in sources if path not in args.also]
    faults = []
    for fault_list, summary in (
        check_links(args.html),
        check_examples(sources, args.sluice, args.fixtures),
        check_schema(args.schema, args.reference),
        check_file_links(args.also),
        check_paths(sources, args.root),
    ) + (
        (check_sections(args.code, args.readme, book_sources), check_algorithm_spread(args.code))
        if args.code
        else ()
    ):
        faults += fault_list
        if not fault_list:
            print(summary)
    for fault in faults:
        print(fault, file=sys.stderr)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
