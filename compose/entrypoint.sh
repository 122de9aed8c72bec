#!/bin/sh
# Entrypoint of the Conveyor image (the engine and the gateway): `conveyor ARGS...`.
#
# Compose starts it as root (`user: "0:0"`) for one step only: each secret in /run/secrets
# (a bind mount keeping the host file's owner and mode, which compose cannot change) is
# copied to /run/conveyor/secrets, owned by the conveyor user (10001), mode 0400, in a 0700
# folder; then it drops to that user for good (setpriv: no root left, no groups) and execs
# conveyor, which so gets SIGTERM itself. Started as that user already (the image's USER,
# e.g. Kubernetes runAsNonRoot), it execs conveyor at once: the secrets must then be
# readable by uid 10001.
set -eu
SECRETS_IN=${CONVEYOR_SECRETS_IN:-/run/secrets}
SECRETS_OUT=${CONVEYOR_SECRETS_OUT:-/run/conveyor/secrets}
CONVEYOR_UID=10001

if [ "$(id -u)" = 0 ]; then
    install -d -o "$CONVEYOR_UID" -g "$CONVEYOR_UID" -m 0700 "$SECRETS_OUT"
    for secret in "$SECRETS_IN"/*; do
        [ -f "$secret" ] || continue
        install -o "$CONVEYOR_UID" -g "$CONVEYOR_UID" -m 0400 "$secret" "$SECRETS_OUT/${secret##*/}"
    done
    exec setpriv --reuid="$CONVEYOR_UID" --regid="$CONVEYOR_UID" --clear-groups -- conveyor "$@"
fi
exec conveyor "$@"
