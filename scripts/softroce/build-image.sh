#!/usr/bin/env bash
# Build, or find in the cache, the soft-RoCE VM image: Debian bookworm (minbase) with the
# generic kernel's rdma_rxe, rdma-core 44, Debian's python3-pyverbs and kvpool's Python deps
# with torch's CPU build in /opt/venv (with system site packages, so pyverbs is visible).
#
#   scripts/softroce/build-image.sh          # prints the image directory on its last line
#
# The image lives in $KVPOOL_CACHE/softroce/<key>/ (KVPOOL_CACHE defaults to
# /var/cache/kvpool), outside the repository, so clean clones on one machine share it. <key>
# hashes everything that goes into it (this script, guest/, the deb and pip package lists,
# which come from pyproject.toml), so a change to any of them builds a new image; older images
# are removed after a successful build. Concurrent builds serialize on a lock file.
# Needs root (debootstrap, chroot, mount) and apt; cold build 1.5-2 min, cached: instant.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${KVPOOL_CACHE:-/var/cache/kvpool}/softroce
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
DEB_PKGS=rdma-core,ibverbs-providers,ibverbs-utils,python3,python3-pyverbs,python3-venv,iproute2,kmod,procps,busybox-static,ca-certificates
# rxe needs crc32_generic, which its module dependencies omit.
ROOT_MODS="virtio_pci virtio_blk virtio_net ext4 crc32c_generic crc32_generic rdma_rxe ib_uverbs 9p 9pnet_virtio dummy"
INITRD_MODS="crc32c_generic virtio_pci virtio_blk ext4"

# kvpool's runtime dependencies and its test runners, as pyproject.toml states them (the VM
# only runs tests: no build tools, no plotting), and torch (kvpool[torch]): the rdma suite moves
# registered torch tensors over real verbs.
PIP_PKGS=$(python3 - "$REPO/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
tests = [d for d in extras["dev"] if d.startswith(("pytest", "hypothesis"))]
print(" ".join(project["dependencies"] + tests + extras["torch"]))
PY
)
TORCH_PIN=$(tr ' ' '\n' <<<"$PIP_PKGS" | grep '^torch==')

t_start=$(date +%s)
log() { echo "[softroce build +$(( $(date +%s) - t_start ))s] $*" >&2; }

key=$( { cat "$0" "$HERE"/guest/*; echo "$SUITE $DEB_PKGS $ROOT_MODS $INITRD_MODS $PIP_PKGS"; } \
       | sha256sum | cut -c1-16)
OUT=$CACHE/$key
is_built() { [ -f "$OUT/stamp" ] && [ -f "$OUT/rootfs.ext4" ] && [ -f "$OUT/initrd.img" ]; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9
if is_built; then
    log "cached image $OUT"
    echo "$OUT"; exit 0
fi

# ---- host tools ---------------------------------------------------------------------------
need=()
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v cpio >/dev/null || need+=(cpio)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
if [ ${#need[@]} -gt 0 ]; then
    log "installing host packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=900 -q update >/dev/null
    apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

WORK=$(mktemp -d "$CACHE/.build.XXXXXX")
ROOT=$WORK/rootfs
cleanup() {
    for m in proc dev; do mountpoint -q "$ROOT/$m" 2>/dev/null && umount -l "$ROOT/$m"; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# ---- 1. root filesystem -------------------------------------------------------------------
log "debootstrap $SUITE"
debootstrap --variant=minbase --include="$DEB_PKGS" "$SUITE" "$ROOT" "$MIRROR" \
    >"$WORK/debootstrap.log" 2>&1 || { tail -30 "$WORK/debootstrap.log" >&2; exit 1; }
cat > "$ROOT/etc/apt/sources.list" <<SRC
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
SRC
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
mount -t proc proc "$ROOT/proc"
mount --bind /dev "$ROOT/dev"
CH() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
           ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
           ${no_proxy:+no_proxy=$no_proxy} "$@"; }

# ---- 2. kernel: the generic flavour (the cloud one has no rdma_rxe), unpacked, not installed --
log "kernel"
CH apt-get -q update >/dev/null
KPKG=$(CH apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2}' | head -n1)
KVER=${KPKG#linux-image-}
CH sh -c "cd /tmp && apt-get -q download $KPKG >/dev/null && dpkg-deb -x /tmp/${KPKG}_*.deb /tmp/kernel"
KROOT=$ROOT/tmp/kernel
MODDIR=/lib/modules/$KVER
CH depmod -b /tmp/kernel "$KVER"
closure() { for m in "$@"; do CH modprobe -d /tmp/kernel -S "$KVER" --show-depends "$m"; done \
                | awk '$1=="insmod"{print $2}' | awk '!seen[$0]++'; }
for f in $(closure $ROOT_MODS); do
    install -D -m644 "$KROOT$MODDIR/${f#/tmp/kernel$MODDIR/}" "$ROOT$MODDIR/${f#/tmp/kernel$MODDIR/}"
done
cp "$KROOT$MODDIR"/modules.{order,builtin,builtin.modinfo} "$ROOT$MODDIR/"
CH depmod "$KVER"

# ---- 3. initramfs: busybox + the modules needed to mount the root disk ----------------------
IRD=$WORK/initramfs
mkdir -p "$IRD"/{bin,dev,proc,sys,newroot,lib/modules}
cp "$ROOT/bin/busybox" "$IRD/bin/busybox"
: > "$IRD/modules.list"
for f in $(closure $INITRD_MODS); do
    cp "$ROOT$f" "$IRD/lib/modules/"
    basename "$f" >> "$IRD/modules.list"
done
install -m755 "$HERE/guest/initramfs-init" "$IRD/init"
(cd "$IRD" && find . | cpio -o -H newc --quiet | gzip -1) > "$WORK/initrd.img"
# An uncompressed ELF kernel boots via PVH, skipping real-mode setup and the XZ decompressor
# (~4 s under TCG).
CH python3 - "/tmp/kernel/boot/vmlinuz-$KVER" /tmp/vmlinux <<'PY'
import lzma, sys
data = open(sys.argv[1], "rb").read()
start = data.find(b"\xfd7zXZ\x00")
out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:]) if start >= 0 else b""
if out[:4] == b"\x7fELF":
    open(sys.argv[2], "wb").write(out)
PY
[ -f "$ROOT/tmp/vmlinux" ] && mv "$ROOT/tmp/vmlinux" "$WORK/vmlinux"
cp "$KROOT/boot/vmlinuz-$KVER" "$WORK/vmlinuz"

# ---- 4. Python deps in a venv that also sees Debian's pyverbs -------------------------------
log "pip install $PIP_PKGS"
CH python3 -m venv --system-site-packages /opt/venv
PIPCERT=
for ca in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    # the host's CA bundle: CI machines behind TLS-intercepting proxies add their CA there
    [ -f "$ca" ] && { cp -L "$ca" "$ROOT/tmp/host-ca.crt"; PIPCERT=PIP_CERT=/tmp/host-ca.crt; break; }
done
# torch's wheel as the host's pip resolves it (its configured wheel sources give the CPU build;
# from PyPI's index alone, `torch==X` is the CUDA one, which pulls GBs of CUDA libraries).
mkdir -p "$ROOT/tmp/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$ROOT/tmp/wheels" "$TORCH_PIN"
TORCH_WHEEL=$(cd "$ROOT/tmp/wheels" && ls torch-*.whl)
case $TORCH_WHEEL in *+cpu*) ;; *) log "expected torch's CPU wheel, got $TORCH_WHEEL"; exit 1;; esac
# shellcheck disable=SC2086
CH $PIPCERT /opt/venv/bin/pip install -q --no-cache-dir --disable-pip-version-check \
    ${PIP_PKGS/$TORCH_PIN/"/tmp/wheels/$TORCH_WHEEL"}
CH /opt/venv/bin/python -c 'import pyverbs.device, numpy, grpc, google.protobuf, structlog, yaml, pytest, torch'

# ---- 5. guest init, kvpool import path, slimming ------------------------------------------------
install -m755 "$HERE/guest/vm-init" "$ROOT/sbin/vm-init"
# The repository root is the package `kvpool`; the guest mounts it at /mnt/project, and this
# directory (on PYTHONPATH in the guest) makes it importable as `kvpool`.
mkdir -p "$ROOT/opt/kvpool-path"
ln -s /mnt/project "$ROOT/opt/kvpool-path/kvpool"
rm -rf "$ROOT"/tmp/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb \
       "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/{doc,man,info,locale}/*
# Complete .pyc caches: compiling numpy/grpc/pytest at import under TCG costs ~20 s per process.
CH python3 -m compileall -q -j0 /opt/venv/lib /usr/lib/python3/dist-packages /usr/lib/python3.11 \
    >/dev/null 2>&1 || true
umount -l "$ROOT/proc" "$ROOT/dev"

# ---- 6. sparse ext4 image, no journal (always booted with snapshot=on) --------------------
used=$(du -sm "$ROOT" | cut -f1)
size=$(( used + used / 4 + 256 ))
log "rootfs $used MiB -> ext4 image of $size MiB (sparse)"
mkfs.ext4 -q -F -L vmroot -m 0 -O ^has_journal -d "$ROOT" "$WORK/rootfs.ext4" "${size}M"

mkdir -p "$WORK/out"
mv "$WORK"/vmlinu[xz] "$WORK/initrd.img" "$WORK/rootfs.ext4" "$WORK/out/"
echo "$key" > "$WORK/out/stamp"
rm -rf "$OUT"
mv "$WORK/out" "$OUT"
for old in "$CACHE"/*/; do
    [ "${old%/}" = "$OUT" ] || rm -rf "$old"
done
log "built $OUT"
echo "$OUT"
