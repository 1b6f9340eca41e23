#!/usr/bin/env bash
# Install the system packages for the local multi-node SLURM test cluster (tests/slurm_cluster).
# Idempotent; Debian 12, root. Nothing is started here: there is no systemd in CI containers and
# the tests start munged, mariadbd, slurmdbd, slurmctld and the slurmds themselves.
set -euo pipefail

packages=(
  slurmctld slurmd slurm-client slurmdbd # Debian 12: Slurm 22.05
  munge                                  # authentication between the daemons and clients
  mariadb-server                         # slurmdbd's database, so sacct works
  iproute2                               # ip link/addr: veth pairs and the bridge
  util-linux                             # unshare/nsenter: one namespace set per node
  procps                                 # pgrep/ps used in diagnostics
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-slurm: all packages already installed"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Without systemd, maintainer scripts would try to start the daemons through invoke-rc.d;
# a policy-rc.d that answers 101 ("action forbidden") keeps them from starting.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  created_policy=1
fi
trap '((created_policy)) && rm -f "$policy"' EXIT

apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-slurm: installed ${missing[*]}"
