#!/usr/bin/env bash
# Container entry point: `peer COMMAND ...` with defaults that make sense inside a container.
#
# For `peer start` and `peer join` it adds, unless the command line already has them:
#   --host $TASKLET_LISTEN_HOST --dht-host $TASKLET_LISTEN_HOST   (default 0.0.0.0: every interface)
#   --port $TASKLET_PORT --dht-port $TASKLET_DHT_PORT             (default 31400 and 31401: fixed, so that they
#                                                                  can be published with `-p` and announced)
#   --bulk-port $TASKLET_BULK_PORT                                 (default 31403: the bulk lane, fixed for `-p`)
#   --announce HOST:PORT    HOST = $TASKLET_ANNOUNCE_HOST, else this container's own address (none when its
#                           hostname has no address, e.g. `--network ns:...`: the peer then finds out). That is the
#                           bridge address (172.17.x.x) under Docker's default networking: right for peers on
#                           the same Docker network (compose), unreachable from anywhere else. Volunteers on
#                           the internet pass --announce PUBLIC_IP:PORT (and forward both ports) or run with
#                           --network host.
#   --identity $TASKLET_IDENTITY                                   (default /tasklet/identity/peer.key, a volume:
#                                                                  the peer keeps its id across restarts)
# With TASKLET_JOIN_FILE set (a file on a volume shared by the containers of one swarm, see compose.yml):
#   `start` writes the DHT address of its join line there; `join` and `status` without --dht wait for that file
#   (at most TASKLET_JOIN_WAIT_S seconds) and use it.
# With TASKLET_DRY_RUN=1 the final `peer` command line is printed (one argument per line), not run.
# Anything else (`status`, `swarm`, `init`, `--help`, ...) goes to `peer` unchanged.
set -euo pipefail

TASKLET_LISTEN_HOST=${TASKLET_LISTEN_HOST:-0.0.0.0}
TASKLET_PORT=${TASKLET_PORT:-31400}
TASKLET_DHT_PORT=${TASKLET_DHT_PORT:-31401}
TASKLET_BULK_PORT=${TASKLET_BULK_PORT:-31403}
TASKLET_IDENTITY=${TASKLET_IDENTITY:-/tasklet/identity/peer.key}
TASKLET_JOIN_FILE=${TASKLET_JOIN_FILE:-}
TASKLET_JOIN_WAIT_S=${TASKLET_JOIN_WAIT_S:-300}
PEER=${TASKLET_PEER:-peer}

die() { echo "entrypoint: error: $*" >&2; exit 2; }

# option_value FLAG ARGS...: print the value given to FLAG (as `FLAG VALUE` or `FLAG=VALUE`); status 1 if absent.
option_value() {
  local flag=$1 found=1 value=""
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      "$flag") if [ $# -ge 2 ]; then value=$2; found=0; shift; fi ;;
      "$flag"=*) value=${1#"$flag"=}; found=0 ;;
    esac
    shift
  done
  [ $found -eq 0 ] && printf '%s\n' "$value"
  return $found
}

has_option() { option_value "$@" >/dev/null; }

# This container's address as other containers on its network see it (first address of its hostname); empty
# when its hostname has none (a container in another network namespace: `--network ns:...`, some host setups).
own_address() {
  python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))' 2>/dev/null \
    || { hostname -i 2>/dev/null | awk '{print $1}'; } || true
}

wait_for_join_file() {
  local waited=0
  while [ ! -s "$TASKLET_JOIN_FILE" ]; do
    [ "$waited" -ge "$TASKLET_JOIN_WAIT_S" ] \
      && die "no join address in $TASKLET_JOIN_FILE after ${TASKLET_JOIN_WAIT_S} s (is the first peer running?)"
    [ "$waited" -eq 0 ] && echo "entrypoint: waiting for the first peer's address in $TASKLET_JOIN_FILE" >&2
    sleep 1
    waited=$((waited + 1))
  done
  head -n 1 "$TASKLET_JOIN_FILE"
}

# Copy the peer's stdout through and save the address of its `peer join --dht ADDR ...` line. The file is
# written (atomically) before the line is passed on, so whoever reads the line can rely on the file.
publish_join_line() {
  local line addr
  while IFS= read -r line; do
    case $line in
      "peer join --dht "*)
        addr=${line#peer join --dht }
        addr=${addr%% *}
        printf '%s\n' "$addr" >"$TASKLET_JOIN_FILE.tmp" && mv -f "$TASKLET_JOIN_FILE.tmp" "$TASKLET_JOIN_FILE"
        ;;
    esac
    printf '%s\n' "$line"
  done
}

command=${1:-}
args=("$@")
extra=()
case $command in
  start | join)
    shift
    has_option --host "$@" || extra+=(--host "$TASKLET_LISTEN_HOST")
    has_option --dht-host "$@" || extra+=(--dht-host "$TASKLET_LISTEN_HOST")
    port=$(option_value --port "$@") || { port=$TASKLET_PORT; extra+=(--port "$port"); }
    has_option --dht-port "$@" || extra+=(--dht-port "$TASKLET_DHT_PORT")
    has_option --bulk-port "$@" || extra+=(--bulk-port "$TASKLET_BULK_PORT")
    has_option --identity "$@" || extra+=(--identity "$TASKLET_IDENTITY")
    if ! has_option --announce "$@"; then
      host=${TASKLET_ANNOUNCE_HOST:-$(own_address)}
      case ${TASKLET_ANNOUNCE_HOST:+given:}$host in  # warn only about an address found here, not one given
        "") echo "entrypoint: no address of this container's own to announce; the peer finds out how it is" \
          "reached (a relay dials it back, else it goes through relays). Pass --announce HOST:PORT to choose" >&2 ;;
        127.*) echo "entrypoint: warning: announcing $host, a loopback address no other machine can reach;" \
          "pass --announce HOST:PORT (see docs/operating.md: Docker)" >&2 ;;
      esac
      [ -z "$host" ] || extra+=(--announce "$host:$port")
    fi
    if [ "$command" = join ] && [ -n "$TASKLET_JOIN_FILE" ] && ! has_option --dht "$@"; then
      addr=$(wait_for_join_file)
      extra+=(--dht "$addr")
    fi
    args=("$command" "${extra[@]}" "$@")
    ;;
  status)
    shift
    if [ -n "$TASKLET_JOIN_FILE" ] && ! has_option --dht "$@"; then
      addr=$(wait_for_join_file)
      args=(status --dht "$addr" "$@")
    fi
    ;;
esac

if [ "${TASKLET_DRY_RUN:-0}" = 1 ]; then
  printf '%s\n' "$PEER" "${args[@]}"
  exit 0
fi

if [ "$command" != start ] || [ -z "$TASKLET_JOIN_FILE" ]; then
  exec "$PEER" "${args[@]}"
fi

# `start` with a join file: the peer runs as a child whose stdout passes through publish_join_line, so this
# shell stays to forward SIGTERM/SIGINT (docker stop) and to return the peer's exit status.
mkdir -p "$(dirname "$TASKLET_JOIN_FILE")"
rm -f "$TASKLET_JOIN_FILE"
"$PEER" "${args[@]}" > >(publish_join_line) &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
# `wait` returns early (status > 128) when a trapped signal arrives; bash keeps the child's real status for
# the last `wait` once it has exited.
while kill -0 "$child" 2>/dev/null; do
  wait "$child" || true
done
status=0
wait "$child" || status=$?
rm -f "$TASKLET_JOIN_FILE"
exit "$status"
