#!/usr/bin/env bash
# Builds the book in docs/ into docs/book/ and checks it:
#   - every internal link and #anchor of the built pages resolves;
#   - every ```yaml example of the book (and of README.md) goes through the real `sluice check`:
#     accepted, or refused when its fence says ```yaml,refused (```yaml,fragment: not a whole
#     policy, not checked);
#   - every field of config/sluice.schema.json is in the policy file's reference page;
#   - every repository path a code span of the book (or README.md) names exists, and every
#     README or book section a comment of src/ cites by its heading exists.
# `bash scripts/book.sh --open` also opens the book in a browser.
#
# mdBook is installed when missing, pinned, from crates.io with cargo into target/book-tools
# (so CI needs nothing but cargo, whatever its CARGO_HOME holds): only the `search` feature,
# not the `serve`/`watch` ones, whose HTTP server and file watcher `build` does not use.
# Measured on the 2-core machine with an empty CARGO_HOME: 1:32 wall, 128 s CPU, 123 crates.
set -euo pipefail
cd "$(dirname "$0")/.."

MDBOOK_VERSION=0.5.4
tools=target/book-tools
mdbook=$tools/bin/mdbook

if ! [ -x "$mdbook" ] || [ "$("$mdbook" --version)" != "mdbook v$MDBOOK_VERSION" ]; then
  echo "== installing mdbook $MDBOOK_VERSION into $tools" >&2
  cargo install mdbook --locked --version "$MDBOOK_VERSION" \
    --no-default-features --features search --root "$tools"
fi

echo "== building the book" >&2
rm -rf docs/book
"$mdbook" build docs

echo "== checking the book" >&2
cargo build --locked --quiet
python3 scripts/book_check.py \
  --html docs/book \
  --src docs/src \
  --also README.md \
  --fixtures docs/fixtures \
  --sluice target/debug/sluice \
  --schema config/sluice.schema.json \
  --reference docs/src/reference/policy.md \
  --root . \
  --code src \
  --readme README.md

echo "the book: docs/book/index.html" >&2
if [ "${1:-}" = --open ]; then
  python3 -m webbrowser "file://$PWD/docs/book/index.html" >/dev/null
fi
