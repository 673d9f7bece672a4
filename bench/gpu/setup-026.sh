#!/usr/bin/env bash
# ON THE DEVICE (the call after p1 was staged in /root/stage): join vLLM 0.26's parts, install it and its deps
# into /root/site (kept while the machine stays warm). Run from the repo root there; then source .gpu/dev/env.sh.
set -e
T0=$(date +%s)
mkdir -p /root/stage && cp -f .gpu/p1/vpart.* .gpu/p2/vpart.* /root/stage/ 2>/dev/null || true
[ "$(cat /root/stage/vpart.* | sha256sum | cut -d' ' -f1)" = "$(cut -d' ' -f1 .gpu/vllm026s.sha256)" ] || { echo "vLLM parts incomplete"; exit 1; }
rm -rf /root/site && mkdir -p /root/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .gpu/whl/*.whl
[ -d .gpu/srvwhl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .gpu/srvwhl/*.whl
cat /root/stage/vpart.* | python3 -c "import sys,tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/root/site')"
for f in /root/moe/*.so .gpu/moe/*.so; do [ -f "$f" ] && cp -f "$f" /root/site/vllm/; done 2>/dev/null || true
echo "vLLM 0.26.0 installed in /root/site in $(( $(date +%s) - T0 )) s"
