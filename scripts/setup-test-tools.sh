#!/usr/bin/env bash
# The system tools only the test suite needs, as root on Debian/Ubuntu (apt-get): nftables and iproute2 for the
# network-namespace bed, chromium for the dashboard's browser test, podman, runc, catatonit, mmdebstrap and
# docker-compose for the container tests, and a runc wrapper (/usr/local/bin/tasklet-runc, with
# /etc/containers/containers.conf naming it when that file is absent) for kernels that refuse to raise rlimits.
# scripts/test.sh runs it before scripts/setup.sh; scripts/demo.sh never does. Every step is tolerant: where one
# fails, or when not root, without apt-get, or with SKIP_APT=1, the tests that need the tool skip with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
# The multi-host test bed (peer/emulation/netbed.py) needs `ip` and `nft`; as root on Debian, install them when missing.
# Quiet and tolerant: when apt fails, those tests skip with the reason. SKIP_APT=1 leaves the system alone.
if [ "$(id -u)" -eq 0 ] && [ -z "${SKIP_APT:-}" ] && command -v apt-get >/dev/null \
   && ! { command -v nft && command -v ip && command -v tc; } >/dev/null 2>&1; then
  echo "[setup] installing nftables and iproute2 for the network-namespace tests" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2; } >/dev/null 2>&1 \
    || echo "[setup] apt-get could not install nftables/iproute2; the network-namespace tests will skip" >&2
fi
# The dashboard test renders the page in headless Chromium; as root on Debian, install it when missing
# (tolerant like the above: without it that test skips with the reason).
if [ "$(id -u)" -eq 0 ] && [ -z "${SKIP_APT:-}" ] && command -v apt-get >/dev/null \
   && ! command -v chromium >/dev/null 2>&1; then
  echo "[setup] installing chromium for the dashboard test" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
    || echo "[setup] apt-get could not install chromium; the dashboard's browser test will skip" >&2
fi
# The container tests (tests/project/test_docker_containers.py) build the images and run them with podman; as root on
# Debian, install podman, runc and mmdebstrap (the base image is made from Debian's packages: no image registry
# is needed). Where the kernel refuses to raise rlimits (some sandboxes), runc fails to start any container, so
# podman gets a runc wrapper that drops `process.rlimits` from the container's config.json, as its default
# runtime. Tolerant like the above: without them those tests skip with the reason.
if [ "$(id -u)" -eq 0 ] && [ -z "${SKIP_APT:-}" ] && command -v apt-get >/dev/null; then
  if ! { command -v podman && command -v runc && command -v mmdebstrap && command -v docker-compose \
         && [ -x /usr/libexec/podman/catatonit ]; } >/dev/null 2>&1
  then
    # docker-compose (Compose 1.29, Debian's) runs the compose file against podman's Docker API in one test;
    # catatonit is podman's init for `init: true` (compose.yml), only a recommendation of the podman package
    echo "[setup] installing podman, runc, catatonit, mmdebstrap and docker-compose for the container tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman runc catatonit mmdebstrap docker-compose; } \
      >/dev/null 2>&1 || echo "[setup] apt-get could not install podman; the container tests will skip" >&2
  fi
  # The wrapper is (re)written on every set-up (it is ours); containers.conf only when there is none.
  if command -v podman >/dev/null && command -v runc >/dev/null \
     && { [ ! -e /etc/containers/containers.conf ] || grep -q tasklet-runc /etc/containers/containers.conf; }; then
    echo "[setup] podman: runc without rlimits (/usr/local/bin/tasklet-runc) as the default runtime" >&2
    cat >/usr/local/bin/tasklet-runc <<EOF
#!/bin/sh
# runc for podman on hosts that refuse to raise rlimits: drops the rlimits from the bundle's config.json
# (containers) and from the process file of "runc exec --process FILE" (podman exec, healthchecks).
# Written by Tasklet's scripts/setup-test-tools.sh.
bundle=.
process=
prev=
for arg in "\$@"; do
  case \$prev in --bundle | -b) bundle=\$arg ;; --process) process=\$arg ;; esac
  case \$arg in --bundle=*) bundle=\${arg#--bundle=} ;; --process=*) process=\${arg#--process=} ;; esac
  prev=\$arg
done
drop() {
  python3 -c 'import json, sys
path, nested = sys.argv[1], sys.argv[2] == "nested"
with open(path) as f:
    spec = json.load(f)
if (spec.get("process", {}) if nested else spec).pop("rlimits", None) is not None:
    with open(path, "w") as f:
        json.dump(spec, f)' "\$1" "\$2" || exit 1
}
if [ -n "\$process" ] && [ -f "\$process" ]; then drop "\$process" top; fi
if [ -f "\$bundle/config.json" ]; then drop "\$bundle/config.json" nested; fi
exec $(command -v runc) "\$@"
EOF
    chmod 0755 /usr/local/bin/tasklet-runc
    if [ ! -e /etc/containers/containers.conf ]; then
      mkdir -p /etc/containers
      printf '[engine]\nruntime = "tasklet-runc"\n\n[engine.runtimes]\ntasklet-runc = ["/usr/local/bin/tasklet-runc"]\n' \
        >/etc/containers/containers.conf
    fi
  fi
fi
