#!/usr/bin/env bash
# What a user installs, checked the way a user gets it. From the tracked files of the checkout:
#   1. builds the source distribution and a wheel from it (`python -m build`) and a wheel straight
#      from the tree (`--wheel`), and fails unless both wheels hold the same files;
#   2. installs that wheel with the `serve` extra into a fresh virtual environment (no system
#      site-packages; torch==2.13.0 first, as the README says);
#   3. from a folder outside the checkout, with an empty PCGTTS_CACHE, runs `pcgtts speak` (the WAV
#      must hold > 0.3 s of audio), `pcgtts voices`, `Synthesizer.from_pretrained().stream(...)` and a
#      short `pcgtts serve` answering one `/v1/audio/speech` request.
# Exit status 0 when every step passes. PYTHON picks the interpreter (default python3);
# PCGTTS_SMOKE_KEEP=1 keeps the work folder (venv, wheels, outputs) for a look afterwards.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pcgtts-smoke.XXXXXX")"
SERVER_PID=""

cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    if [ "${PCGTTS_SMOKE_KEEP:-0}" = "1" ]; then
        echo "wheel smoke: work folder kept at $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

START=$(date +%s)
step() { echo "== wheel smoke [$(( $(date +%s) - START )) s]: $*"; }

# --- 1. the distributions -------------------------------------------------------------------------
# A release is built from the tracked files only: copy them, so nothing untracked (a local export,
# a build/ folder) slips into the wheel, and nothing is written into the checkout.
SRC="$WORK/src"
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z | while IFS= read -r -d '' f; do
        [ -f "$f" ] && printf '%s\0' "$f"
    done | xargs -0 cp --parents -t "$SRC")
else
    cp -a "$ROOT/." "$SRC"
fi

step "building the sdist and a wheel from it, and a wheel from the tree"
"$PY" -m build --outdir "$WORK/dist" "$SRC" >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
"$PY" -m build --wheel --outdir "$WORK/direct" "$SRC" >>"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/*.whl)"
"$PY" - "$WHEEL" "$WORK"/direct/*.whl "$WORK"/dist/*.tar.gz <<'EOF'
import sys, zipfile, tarfile
from_sdist, direct, sdist = sys.argv[1:4]
a = set(zipfile.ZipFile(from_sdist).namelist())
b = set(zipfile.ZipFile(direct).namelist())
a_only, b_only = sorted(a - b), sorted(b - a)
if a_only or b_only:
    sys.exit(f"the wheels differ: only in the one from the sdist: {a_only}; only in the direct one: {b_only}")
with tarfile.open(sdist) as t:
    sdist_files = len([m for m in t.getmembers() if m.isfile()])
print(f"wheels agree: {len(a)} files; sdist: {sdist_files} files")
for needed in ("pcgtts/voice/voices/voices.json", "pcgtts/voice/voice.json", "pcgtts/train/presets.json",
               "pcgtts/quality/testset_v1.json"):
    if needed not in a:
        sys.exit(f"the wheel lacks {needed}")
EOF

# --- 2. a fresh virtual environment ----------------------------------------------------------------
step "installing torch==2.13.0 and the wheel with the serve extra into a fresh venv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
t0=$(date +%s)
{ "$VPY" -m pip install -q "torch==2.13.0" && "$VPY" -m pip install -q "$WHEEL[serve]"; } >"$WORK/pip.log" 2>&1 \
    || { tail -40 "$WORK/pip.log"; exit 1; }
echo "installed in $(( $(date +%s) - t0 )) s"

# --- 3. as a user: outside the checkout, an empty cache ---------------------------------------------
USER_DIR="$WORK/user"
mkdir -p "$USER_DIR" "$WORK/cache"
cd "$USER_DIR"
unset PYTHONPATH
export PCGTTS_CACHE="$WORK/cache"
export PATH="$WORK/venv/bin:$PATH"
hash -r

step "import pcgtts resolves to the venv's site-packages"
"$VPY" - "$ROOT" <<'EOF'
import sys, sysconfig
from pathlib import Path
import pcgtts
where = Path(pcgtts.__file__).resolve()
site = Path(sysconfig.get_paths()["purelib"]).resolve()
checkout = Path(sys.argv[1]).resolve()
if site not in where.parents or checkout in where.parents:
    sys.exit(f"import pcgtts found {where}, not the venv's site-packages {site}")
print(f"pcgtts {pcgtts.__version__} from {where.parent}")
EOF

step "pcgtts speak (first use: prepares the built-in voice)"
t0=$(date +%s)
pcgtts speak "Hello world" --out hello.wav
echo "first speak: $(( $(date +%s) - t0 )) s"
"$VPY" - <<'EOF'
import sys
import soundfile
info = soundfile.info("hello.wav")
if info.frames == 0 or info.duration <= 0.3:
    sys.exit(f"hello.wav holds {info.duration:.2f} s of audio")
print(f"hello.wav: {info.duration:.2f} s at {info.samplerate} Hz")
EOF

step "pcgtts voices"
pcgtts voices

step "Synthesizer.from_pretrained().stream(text, voice='nova')"
"$VPY" - <<'EOF'
import sys
from pcgtts import Synthesizer
synth = Synthesizer.from_pretrained()
chunks = list(synth.stream("The quick brown fox jumps over the lazy dog.", voice="nova"))
samples = sum(len(chunk.samples) for chunk in chunks)
if not chunks or samples == 0:
    sys.exit("the stream gave no audio")
print(f"stream: {len(chunks)} chunks, {samples} samples")
EOF

step "pcgtts serve and one /v1/audio/speech request"
PORT="$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
pcgtts serve --host 127.0.0.1 --port "$PORT" --workers 1 >"$WORK/serve.log" 2>&1 &
SERVER_PID=$!
"$VPY" - "$PORT" "$SERVER_PID" <<'EOF' || { tail -40 "$WORK/serve.log"; exit 1; }
import io, json, os, sys, time, urllib.error, urllib.request
import soundfile
port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
            print("health:", response.read().decode())
            break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit("pcgtts serve exited before answering /health")
        if time.monotonic() > deadline:
            sys.exit("pcgtts serve did not answer /health within 300 s")
        time.sleep(1)
body = json.dumps({"model": "pcgtts", "input": "Hello from the server, speaking as one of the preset voices.", "voice": "alloy",
                   "response_format": "wav"}).encode()
request = urllib.request.Request(f"{base}/v1/audio/speech", data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=300) as response:
    audio = response.read()
data, rate = soundfile.read(io.BytesIO(audio))
if len(data) / rate <= 0.3:
    sys.exit(f"the server's WAV holds {len(data) / rate:.2f} s of audio")
print(f"/v1/audio/speech: {len(data) / rate:.2f} s at {rate} Hz")
EOF
kill "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
SERVER_PID=""

step "the background export finishes, and a later speak runs on its int8 graphs"
"$VPY" - <<'EOF' || { tail -40 "$PCGTTS_CACHE"/voice-*/export.log 2>/dev/null; exit 1; }
import sys, time
from pcgtts.builtin import voice_cache
from pcgtts.runtime.prepared import ONNX_STAGE, is_prepared
folder, started = voice_cache(), time.monotonic()
while not is_prepared(folder, (ONNX_STAGE,)):
    if time.monotonic() - started > 600:
        sys.exit(f"the built-in voice's onnxruntime graphs were not ready in {folder} within 600 s")
    time.sleep(2)
print(f"int8 graphs ready after {time.monotonic() - started:.0f} s more")
EOF
t0=$(date +%s)
pcgtts speak "Hello again, from the int8 graphs." --out again.wav -v 2> again.log || { cat again.log; exit 1; }
echo "later speak: $(( $(date +%s) - t0 )) s"
grep -q "CPUExecutionProvider: model.int8.onnx" again.log || {
    echo "the later speak did not run the int8 graphs:"; cat again.log; exit 1; }

step "passed"
