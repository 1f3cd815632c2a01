#!/bin/bash
# Runs a command inside an image's root filesystem the way a Kubernetes pod with the rendered
# securityContext runs it: its own network namespace holding only loopback and the pod's IP,
# its own mount and PID namespaces, the root filesystem read-only, an empty writable tmpfs at
# each emptyDir mount path, /proc, /dev and a memory /dev/shm, as a numeric non-root user,
# with exactly the environment given. Root only (it makes namespaces and mounts).
#
#   pod_sandbox.sh IMAGE_ROOT POD_IP UID:GID MOUNT_PATHS ENV_FILE -- COMMAND...
#
# IMAGE_ROOT  the image's root filesystem (`podman image mount IMAGE`), never written to
# MOUNT_PATHS comma-separated emptyDir mount paths, e.g. /tmp,/var/cache/tandem
# ENV_FILE    NAME=VALUE lines, the container's whole environment
# POD_SANDBOX_BINDS (environment, optional): space-separated HOST_DIR:PATH pairs mounted
#             read-only at PATH, standing in for ConfigMap and Secret volumes
#
# Everything it mounts lives in the namespaces it makes, so it all goes when the command ends
# (or when this script is killed: the pod's processes are killed with it).
set -euo pipefail

if [[ "${1:-}" != "--inside" ]]; then
    # The outer call: new namespaces, then this script again inside them. --kill-child ends
    # the pod's processes when this one is killed.
    exec unshare --mount --net --pid --fork --kill-child "$0" --inside "$@"
fi
shift
image_root=$1 pod_ip=$2 user=$3 mount_paths=$4 env_file=$5
shift 5
[[ "$1" == "--" ]] && shift

ip link set lo up
# The pod's address (no other interface: nothing outside the namespace is reachable; the
# dummy driver is not in every kernel, loopback is).
ip addr add "$pod_ip/32" dev lo

mount --make-rprivate /
# Scratch space on a tmpfs over /mnt, in this mount namespace only: it goes with it.
scratch=/mnt
mount -t tmpfs -o size=64m tmpfs "$scratch"
mkdir -p "$scratch/upper" "$scratch/work" "$scratch/root"
# An overlay only to create the mount points the pod's volumes need (the kubelet's runtime
# does the same); the root is then made read-only.
mount -t overlay overlay \
    -o "lowerdir=$image_root,upperdir=$scratch/upper,workdir=$scratch/work" "$scratch/root"
root=$scratch/root
IFS=, read -r -a paths <<< "$mount_paths"
read -r -a binds <<< "${POD_SANDBOX_BINDS:-}"
for path in "${paths[@]}"; do
    mkdir -p "$root$path"
done
for bind in "${binds[@]}"; do
    mkdir -p "$root${bind#*:}"
done
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o size=1g,mode=1777 tmpfs "$root/dev/shm"
for path in "${paths[@]}"; do
    mount -t tmpfs -o size=2g,mode=1777 tmpfs "$root$path"
done
for bind in "${binds[@]}"; do
    mount --bind "${bind%%:*}" "$root${bind#*:}"
    mount -o remount,bind,ro "$root${bind#*:}"
done

mapfile -t environment < "$env_file"
exec chroot --userspec="$user" "$root" /usr/bin/env -i "${environment[@]}" "$@"
