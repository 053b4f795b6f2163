#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for the distributed-tuning tests.
#
#   source .ci/postgres.sh     # exports SPCOMPILE_TEST_PG_URL (+ _PG_DATA, _PG_CTL)
#   bash .ci/postgres.sh       # same, printed as KEY=VALUE lines
#
# Idempotent: a reachable SPCOMPILE_TEST_PG_URL is kept.  Installs Debian's postgresql package
# when no server binaries are found (unless SPCOMPILE_PG_NO_INSTALL=1), creates a cluster in a
# temporary directory owned by a non-root user (postgres refuses to run as root), starts it on a
# free port with trust authentication on 127.0.0.1 only, and creates the database spcompile_test.
# Stop it with: runuser -u "$SPCOMPILE_TEST_PG_OWNER" -- "$SPCOMPILE_TEST_PG_CTL" -D "$SPCOMPILE_TEST_PG_DATA" stop
# Failures are reported on stderr and return non-zero without ending the calling shell.

_spc_pg_log() { echo "[postgres.sh] $*" >&2; }

_spc_pg_bindir() {
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then echo "$d"; return 0; fi
  done
  if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
    dirname "$(command -v initdb)"; return 0
  fi
  return 1
}

_spc_pg_reachable() {
  python3 - "$1" <<'EOF' >/dev/null 2>&1
import sys
import sqlalchemy as sa
e = sa.create_engine(sys.argv[1], connect_args={"connect_timeout": 3})
with e.connect() as c:
    c.execute(sa.text("select 1"))
EOF
}

_spc_pg_setup() {
  if [ -n "${SPCOMPILE_TEST_PG_URL:-}" ] && _spc_pg_reachable "$SPCOMPILE_TEST_PG_URL"; then
    _spc_pg_log "using the running server at ${SPCOMPILE_TEST_PG_URL}"
    return 0
  fi
  if ! python3 -c "import psycopg2" >/dev/null 2>&1; then
    python3 -m pip install -q "psycopg2-binary>=2.9" >&2 || { _spc_pg_log "cannot install psycopg2-binary"; return 1; }
  fi
  local bindir
  if ! bindir="$(_spc_pg_bindir)"; then
    if [ "${SPCOMPILE_PG_NO_INSTALL:-0}" = "1" ]; then
      _spc_pg_log "no PostgreSQL server binaries and installing is disabled"; return 1
    fi
    local sudo=""
    [ "$(id -u)" = "0" ] || sudo="sudo -n"
    _spc_pg_log "installing the Debian postgresql package"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 || { _spc_pg_log "apt-get update failed"; return 1; }
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >&2 \
      || { _spc_pg_log "apt-get install postgresql failed"; return 1; }
    bindir="$(_spc_pg_bindir)" || { _spc_pg_log "postgresql installed but initdb/pg_ctl not found"; return 1; }
  fi

  # postgres refuses to run as root: run the cluster as the 'postgres' user (made if missing)
  local run=()
  local owner
  owner="$(id -un)"
  if [ "$(id -u)" = "0" ]; then
    if ! id postgres >/dev/null 2>&1; then
      useradd --system --home-dir /var/lib/postgresql --shell /bin/sh postgres 2>/dev/null \
        || { _spc_pg_log "cannot create the postgres user"; return 1; }
    fi
    owner=postgres
    run=(runuser -u postgres --)
    command -v runuser >/dev/null 2>&1 || run=(su postgres -s /bin/sh -c)
  fi

  local base port
  base="$(mktemp -d /tmp/spcompile-pg.XXXXXX)" || return 1
  mkdir -p "$base/data" "$base/sock"
  [ "$owner" = "$(id -un)" ] || chown -R "$owner" "$base"
  chmod 700 "$base/data"
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"

  _spc_pg_run() {
    if [ "${run[0]:-}" = "su" ]; then "${run[@]}" "$(printf '%q ' "$@")"; else "${run[@]}" "$@"; fi
  }
  if ! _spc_pg_run "$bindir/initdb" -D "$base/data" -U postgres --auth=trust -E UTF8 >"$base/initdb.log" 2>&1; then
    _spc_pg_log "initdb failed:"; cat "$base/initdb.log" >&2; return 1
  fi
  if ! _spc_pg_run "$bindir/pg_ctl" -D "$base/data" -l "$base/server.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $base/sock -c max_connections=200 -c fsync=off" start >&2; then
    _spc_pg_log "the server did not start:"; cat "$base/server.log" >&2; return 1
  fi
  if ! _spc_pg_run "$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -q \
      -c "CREATE DATABASE spcompile_test" >&2; then
    _spc_pg_log "CREATE DATABASE failed"; return 1
  fi
  export SPCOMPILE_TEST_PG_URL="postgresql+psycopg2://postgres@127.0.0.1:${port}/spcompile_test"
  export SPCOMPILE_TEST_PG_DATA="$base/data"
  export SPCOMPILE_TEST_PG_CTL="$bindir/pg_ctl"
  export SPCOMPILE_TEST_PG_OWNER="$owner"
  _spc_pg_log "PostgreSQL running: ${SPCOMPILE_TEST_PG_URL} (data ${base}/data, owner ${owner})"
  return 0
}

if _spc_pg_setup; then
  echo "SPCOMPILE_TEST_PG_URL=${SPCOMPILE_TEST_PG_URL}"
  echo "SPCOMPILE_TEST_PG_DATA=${SPCOMPILE_TEST_PG_DATA:-}"
  echo "SPCOMPILE_TEST_PG_CTL=${SPCOMPILE_TEST_PG_CTL:-}"
  echo "SPCOMPILE_TEST_PG_OWNER=${SPCOMPILE_TEST_PG_OWNER:-}"
else
  _spc_pg_log "no PostgreSQL server: the postgres tests will try again and fail in CI"
  if [ "${BASH_SOURCE[0]}" = "$0" ]; then exit 1; fi
fi
