#!/usr/bin/env bash
# Set up a fresh Debian 12 machine (as root) for weenv: Debian's packages that
# weenv drives (crun and runc, tini, erofs-utils, fuse3, debootstrap, dockerd and a
# registry for the benchmarks, chromium for the dashboard's browser tests), then a venv in .venv with weenv, its test
# tools (SeaweedFS's weed for the s3:// tests), matplotlib, mini-swe-agent
# (weenv[minisweagent]), SWE-ReX (weenv[swerex]), boto3 (weenv[s3]), MkDocs with the Material theme
# (weenv[docs]: the documentation site, `mkdocs build --strict`), and the
# benchmarks (benchmarks/, weenv-bench), both editable; and NeMo Gym's venv,
# /work/venvs/nemo (Python 3.12 from pyenv; $WEENV_NEMO_VENV to move it), with
# nemo-gym and a checkout's weenv editable ('.[nemo]', made again only when setup.py or
# pyproject.toml change), for tests/test_adapters_nemo.py.  Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(runc crun tini erofs-utils fuse3 btrfs-progs debootstrap util-linux libcap2-bin iproute2 nftables docker.io docker-registry skopeo gcc libc6-dev chromium)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
fi
[ -e /dev/fuse ] || modprobe fuse

# crun 1.x refuses a hybrid cgroup host (v1 hierarchies, a cgroup2 one beside
# them) whose cgroup2 hierarchy holds controllers: bind each of them to a v1
# hierarchy of its own (a controller moves only while no cgroup below uses
# it).  A pure v2 or pure v1 host is left as it is.
if [ "$(stat -f -c %T /sys/fs/cgroup)" = tmpfs ] && [ "$(stat -f -c %T /sys/fs/cgroup/unified 2>/dev/null)" = cgroup2fs ]; then
  for c in $(cat /sys/fs/cgroup/unified/cgroup.controllers); do
    echo "setup: hybrid cgroups: binding the $c controller from the cgroup2 hierarchy to a v1 hierarchy at /sys/fs/cgroup/$c (crun refuses controllers on cgroup2 here)" >&2
    mkdir -p "/sys/fs/cgroup/$c"
    mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
  done
fi

# weenv needs Python >= 3.11.4 (tarfile's extraction filters, PEP 706); Debian 12's
# python3 is 3.11.2: then the newest 3.11+ that pyenv has
py_ok() { "$1" -c 'import sys, tarfile; sys.exit(sys.version_info < (3, 11, 4) or not hasattr(tarfile, "data_filter"))' 2>/dev/null; }
if [ ! -x .venv/bin/python ] || ! py_ok .venv/bin/python; then
  base=""
  for candidate in "$(command -v python3 || true)" $(ls -d /root/.pyenv/versions/3.1[1-9]*/bin/python 2>/dev/null | sort -rV); do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && py_ok "$candidate"; then base="$candidate"; break; fi
  done
  if [ -z "$base" ]; then
    echo "setup: weenv needs Python >= 3.11.4 (tarfile extraction filters); none found (python3, /root/.pyenv/versions/3.11+)" >&2
    exit 1
  fi
  rm -rf .venv
  "$base" -m venv .venv
fi
stale() { for f in pyproject.toml setup.py benchmarks/pyproject.toml; do [ "$f" -nt .venv/.weenv-installed ] && return 0; done; return 1; }
if ! .venv/bin/python -c 'import weenv, weenv_bench, pytest, boto3, mkdocs, material, playwright, pydantic_settings, swerex, aiohttp, hypothesis, schemathesis' 2>/dev/null || [ ! -x .venv/bin/weed ] || stale; then
  echo "setup: installing weenv and its benchmarks into .venv" >&2
  # the benchmarks editable beside weenv: '.[bench]' would install a copy of them
  .venv/bin/pip install --quiet --disable-pip-version-check -e '.[test,plot,minisweagent,swerex,cluster,s3,docs]' -e ./benchmarks 2>&1 | grep -v 'is ignored' || true
  .venv/bin/python -c 'import weenv, weenv_bench, pytest, boto3, mkdocs, material, playwright, pydantic_settings, swerex, aiohttp, hypothesis, schemathesis'
  touch .venv/.weenv-installed
fi

# NeMo Gym needs Python >= 3.12: a venv of its own (about 2 minutes the first time)
nemo=${WEENV_NEMO_VENV:-/work/venvs/nemo}
py312=$(ls -d /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | sort -V | tail -1 || true)
# The test runs it with this checkout's src first on PYTHONPATH: the venv needs nemo-gym, weenv's
# requirements and weenv's entry point, from any checkout whose setup.py and pyproject.toml are these
# (their digest is kept in the marker), so a fresh clone of the same commit installs nothing again.
nemo_key=$(cat setup.py pyproject.toml | sha256sum | cut -c1-16)
nemo_ok() {
  PYTHONPATH="$PWD/src" "$nemo/bin/python" -c 'import nemo_gym, weenv.adapters.nemo
from importlib.metadata import entry_points
assert entry_points(group="nemo_gym.sandbox_providers", name="weenv")' 2>/dev/null
}
if [ -n "$py312" ]; then
  if [ ! -x "$nemo/bin/python" ]; then
    mkdir -p "$(dirname "$nemo")"
    "$py312" -m venv "$nemo"
  fi
  if [ "$(cat "$nemo/.weenv-installed" 2>/dev/null)" != "$nemo_key" ] || ! nemo_ok; then
    echo "setup: installing nemo-gym and weenv into $nemo" >&2
    "$nemo/bin/pip" install --quiet --disable-pip-version-check -e '.[nemo]' 2>&1 | grep -v 'is ignored' || true
    nemo_ok || { echo "setup: $nemo cannot import nemo_gym and weenv.adapters.nemo, or has no weenv entry point" >&2; exit 1; }
    echo "$nemo_key" > "$nemo/.weenv-installed"
  fi
else
  echo "setup: no Python 3.12 under /root/.pyenv: NeMo Gym's venv not made (its test is skipped)" >&2
fi
# Harbor (PyPI harbor[e2b], the Terminal-Bench harness, driven by tests/test_harbor.py against
# `weenv serve`) needs Python >= 3.12: a venv of its own, /work/venvs/harbor (WEENV_HARBOR_VENV),
# made with a python3.12+ found on the machine (pyenv's, or on PATH).
harbor_venv="${WEENV_HARBOR_VENV:-/work/venvs/harbor}"
if [ ! -x "$harbor_venv/bin/harbor" ] || ! "$harbor_venv/bin/python" -c 'import e2b, harbor' 2>/dev/null; then
  py312=""
  for candidate in /root/.pyenv/versions/3.1[2-9]*/bin/python "$(command -v python3.13 || true)" "$(command -v python3.12 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      py312="$candidate"; break
    fi
  done
  if [ -z "$py312" ]; then
    echo "setup: Harbor needs Python >= 3.12 and none was found (pyenv's /root/.pyenv/versions/3.12*, python3.12 or python3.13 on PATH)" >&2
    exit 1
  fi
  echo "setup: making Harbor's venv $harbor_venv with $py312" >&2
  mkdir -p "$(dirname "$harbor_venv")"
  "$py312" -m venv "$harbor_venv"
  "$harbor_venv/bin/pip" install --quiet --disable-pip-version-check 'harbor[e2b]' 2>&1 | grep -v 'is ignored' || true
  "$harbor_venv/bin/python" -c 'import e2b, harbor'
fi
# prime-sandboxes (Prime Intellect's sandbox client, which verifiers' environments use; driven by
# tests/test_prime.py against `weenv serve`) and verifiers: a venv of their own, /work/venvs/prime
# (WEENV_PRIME_VENV), as their connectrpc wants another protobuf-py than the e2b SDK in .venv.
# verifiers needs Python >= 3.11: the interpreter .venv was made with.
prime_venv="${WEENV_PRIME_VENV:-/work/venvs/prime}"
if [ ! -x "$prime_venv/bin/python" ] || ! "$prime_venv/bin/python" -c 'import prime_sandboxes, verifiers' 2>/dev/null; then
  echo "setup: making the prime-sandboxes venv $prime_venv" >&2
  mkdir -p "$(dirname "$prime_venv")"
  "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv "$prime_venv"
  "$prime_venv/bin/pip" install --quiet --disable-pip-version-check prime-sandboxes verifiers 2>&1 | grep -v 'is ignored' || true
  "$prime_venv/bin/python" -c 'import prime_sandboxes, verifiers'
fi
