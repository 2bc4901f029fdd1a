# install_if_missing, for the project's scripts to source (test.sh, soak.sh, check-image.sh):
# each installs what it needs itself, so a new machine needs nothing installed by hand.

# Installs the Debian/Ubuntu package $2 (or the Homebrew formula $3, `redis` unless given)
# when the command $1 is missing.
install_if_missing() {
  local command=$1 package=$2 formula=${3:-redis}
  if command -v "$command" >/dev/null 2>&1; then return; fi
  echo "$command not found; installing it" >&2
  if command -v apt-get >/dev/null 2>&1; then
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" >/dev/null
  elif command -v brew >/dev/null 2>&1; then
    brew install "$formula"
  else
    echo "cannot install $command here: install the $package package (see README) and run this again" >&2
    exit 1
  fi
}
