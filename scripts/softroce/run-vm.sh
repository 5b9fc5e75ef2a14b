#!/usr/bin/env bash
# Boot the soft-RoCE VM, run one command inside it, power off, exit with the command's status.
#
#   scripts/softroce/run-vm.sh [-t TIMEOUT_S] [-m MEM_MB] [-c CPUS] [-e VAR=VALUE]... -- CMD ARGS...
#
# The repository is shared read-write (virtio-9p) at /mnt/project, the command's working
# directory, and `import kvpool` resolves to it. Inside: root, rxe0 on eth0 (10.0.2.15),
# /opt/venv/bin first on PATH. Exit status: the command's; 124 if it ran past TIMEOUT_S
# (default 900); 125 if the VM gave no status (did not boot, crashed).
# ACCEL=kvm|tcg overrides the accelerator: KVM only where /dev/kvm is usable and the CPU shows
# vmx/svm (a nested "PVM" /dev/kvm cannot boot a stock kernel), else TCG.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
TIMEOUT=900; MEM=4096; CPUS=$(nproc); ENVS=()
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while getopts "t:m:c:e:h" o; do
    case $o in t) TIMEOUT=$OPTARG;; m) MEM=$OPTARG;; c) CPUS=$OPTARG;; e) ENVS+=("$OPTARG");;
               *) usage;; esac
done
shift $((OPTIND - 1)); [ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || usage
[ "$CPUS" -gt 8 ] && CPUS=8

IMAGE=$("$HERE/build-image.sh" | tail -n1)

if [ -z "${ACCEL:-}" ]; then
    if [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then ACCEL=kvm; else ACCEL=tcg; fi
fi
if [ "$ACCEL" = kvm ]; then
    ACC=(-accel kvm -cpu host)
else
    # Hidden from the guest because TCG emulates them slowly: ERMS/FSRM ("rep movsb" runs byte
    # by byte; memcpy ~3x faster without), PCLMULQDQ (rxe's ICRC then uses crc32-generic),
    # AVX/AVX2/FMA (numpy and glibc fall back to SSE4.2 paths).
    ACC=(-accel tcg,thread=multi,tb-size=1024
         -cpu max,erms=off,fsrm=off,pclmulqdq=off,avx=off,avx2=off,fma=off)
fi
KERNEL=$IMAGE/vmlinux
[ -f "$KERNEL" ] || KERNEL=$IMAGE/vmlinuz

JOB=$(mktemp -d /tmp/softroce-job.XXXXXX)
trap 'rm -rf "$JOB"' EXIT
printf '%q ' "$@" > "$JOB/cmd.sh"; echo >> "$JOB/cmd.sh"
for kv in "${ENVS[@]+"${ENVS[@]}"}"; do printf 'export %q\n' "$kv" >> "$JOB/env.sh"; done

echo "[run-vm] accel=$ACCEL cpus=$CPUS mem=${MEM}M timeout=${TIMEOUT}s image=$IMAGE" >&2
t0=$(date +%s.%N)
set +e
timeout --foreground -k 10 "$TIMEOUT" qemu-system-x86_64 "${ACC[@]}" \
    -machine pc -smp "$CPUS" -m "$MEM" \
    -nodefaults -no-user-config -display none -serial stdio -no-reboot \
    -kernel "$KERNEL" -initrd "$IMAGE/initrd.img" \
    -append "console=ttyS0 root=/dev/vda rw quiet loglevel=4 panic=-1" \
    -drive "file=$IMAGE/rootfs.ext4,if=virtio,format=raw,snapshot=on,cache=unsafe" \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0,romfile= \
    -virtfs "local,path=$JOB,mount_tag=job,security_model=none,id=job" \
    -virtfs "local,path=$REPO,mount_tag=project,security_model=none,id=project" </dev/null
qemu_rc=$?
set -e
rc=$(cat "$JOB/exit_code" 2>/dev/null || true)
printf '[run-vm] qemu exit %s, command exit %s, wall %.0fs\n' "$qemu_rc" "${rc:-none}" \
    "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" >&2
[ "$qemu_rc" -eq 124 ] && exit 124
[ -n "$rc" ] && exit "$rc"
exit 125
