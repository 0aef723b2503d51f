#!/usr/bin/env bash
# The project's main job, from a fresh clone: set up .venv, then train a 4-peer swarm on this machine over an
# emulated world-wide network (Oregon, Virginia, Ohio, Tokyo) for 5 steps. Extra arguments go to `peer swarm`
# (e.g. `bash scripts/demo.sh --steps 20 --save out/`); `.venv/bin/peer swarm --help` lists them.
# It leaves the system alone: scripts/setup.sh writes only the virtualenv (VENV, default .venv, in the checkout) and
# pip's download cache; the swarm's logs and results go to a temporary folder it prints. No apt-get, root or not.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv}
bash scripts/setup.sh
exec "$VENV/bin/peer" swarm --peers 4 --scenario worldwide_geo_distributed --steps 5 "$@"
