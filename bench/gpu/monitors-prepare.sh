#!/usr/bin/env bash
# Here, once per machine: the staged parts monitors-run.sh carries (G, default .gpu/mon), made from
# ../shared/gpu/prepare.sh's .gpu (run first when missing): vLLM 0.26's stripped archive re-split 40 + 28 MiB (each device
# call also carries the tree, ~10.5 MB and growing with bench/results: call 1 the first part, call 2 the second and the server packages),
# the server's wheels (srvwhl) unpacked into one site folder and xz'd (srvx: 10.6 MB instead of 21.3), and py-spy (spy),
# so that no device call carries more than ~54 MB of the 67.1 MB allowed (three calls: monitors-run.sh's header).
# Then `monitors-run.sh stage COMMIT`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
S=${S:-$ROOT/.gpu}
G=${G:-$S/mon}
cd "$ROOT"
if [ ! -f "$S/vllm026s.tar.xz" ] || [ ! -d "$S/srvwhl" ]; then
  TOK=$(.venv/bin/python -m vllm_worker.shipped_model | tail -1)  # tokenizer files for the dummy model
  bash "$ROOT/../shared/gpu/prepare.sh" "$TOK"
fi
mkdir -p "$G"
rm -rf "$G/p1" "$G/p2" "$G/whl" "$G/dev" "$G/model" "$G/srvx"
mkdir -p "$G/p1" "$G/p2" "$G/srvx"
(cd "$G" && split -b 40M -d -a 2 "$S/vllm026s.tar.xz" vpart. && mv vpart.00 p1/ && mv vpart.01 p2/)
cp "$S/vllm026s.sha256" "$G/"
cp -r "$S/whl" "$S/dev" "$S/model" "$G/"
SITE=$(mktemp -d)
for w in "$S"/srvwhl/*.whl; do unzip -q -o "$w" -d "$SITE"; done
tar -cf - -C "$SITE" . | xz -9 -T2 > "$G/srvx/srv.tar.xz"
(cd "$G/srvx" && sha256sum srv.tar.xz > srv.sha256)
rm -rf "$SITE"
# py-spy's wheel (2.8 MB) for `monitors-run.sh profile`: host-side profiles of the bench's engines
mkdir -p "$G/spy"
ls "$G"/spy/py_spy-*.whl > /dev/null 2>&1 || .venv/bin/python -m pip download -q --no-deps -d "$G/spy" py-spy==0.4.1
du -sh "$G"/{p1,p2,whl,srvx,dev,model,spy}
