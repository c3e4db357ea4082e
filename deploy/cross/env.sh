# Sourced, not run, by POSIX sh too (Docker's RUN sources it with dash): the Rust target and,
# when it is not this machine's architecture, the cross toolchain's environment for cargo, for
# the cc crate, and for librdkafka's ./configure (which reads plain CC/CXX/AR). One place for
# deploy/Dockerfile's multi-platform build and for deploy/cross/arm64.
#   TARGETARCH=arm64 . deploy/cross/env.sh     TARGETARCH: amd64 or arm64, Docker's names (the
#                                              Dockerfile's ARG); unset: this machine's
# Sets RUST_TARGET (and STRIP); for a foreign ARCH the toolchain must be installed: Debian's
# gcc-<gnu triple> and g++-<gnu triple>, and libssl-dev:ARCH (dpkg --add-architecture ARCH):
# CROSS_PACKAGES lists them.
cross_arch=${TARGETARCH:-$(dpkg --print-architecture)}
case $cross_arch in
    amd64) RUST_TARGET=x86_64-unknown-linux-gnu cross_gnu=x86_64-linux-gnu ;;
    arm64) RUST_TARGET=aarch64-unknown-linux-gnu cross_gnu=aarch64-linux-gnu ;;
    *) echo "deploy/cross/env.sh: no Rust target for $cross_arch (amd64 or arm64)" >&2; return 1 ;;
esac
export RUST_TARGET STRIP=strip
CROSS_PACKAGES=""
if [ "$cross_arch" != "$(dpkg --print-architecture)" ]; then
    cross_package=$(echo "$cross_gnu" | tr _ -)
    CROSS_PACKAGES="gcc-$cross_package g++-$cross_package libssl-dev:$cross_arch"
    cross_var=$(echo "$RUST_TARGET" | tr 'a-z-' 'A-Z_')
    cross_lower=$(echo "$RUST_TARGET" | tr - _)
    host_target=$(rustc -vV 2>/dev/null | sed -n 's/^host: //p' | tr - _)
    export "CARGO_TARGET_${cross_var}_LINKER=$cross_gnu-gcc"
    export "CC_$cross_lower=$cross_gnu-gcc" "CXX_$cross_lower=$cross_gnu-g++" "AR_$cross_lower=$cross_gnu-ar"
    # plain CC/CXX/AR are the target's (librdkafka's mklove reads them); the host's C compiler
    # is named for the cc crate's host builds
    export CC=$cross_gnu-gcc CXX=$cross_gnu-g++ AR=$cross_gnu-ar HOST_CC=gcc HOST_CXX=g++ STRIP=$cross_gnu-strip
    [ -z "$host_target" ] || export "CC_$host_target=gcc" "CXX_$host_target=g++" "AR_$host_target=ar"
    # pkg-config and openssl-sys look at the target's libraries (Debian multiarch paths) only
    export PKG_CONFIG_ALLOW_CROSS=1 PKG_CONFIG_LIBDIR=/usr/lib/$cross_gnu/pkgconfig:/usr/share/pkgconfig
    export "${cross_var}_OPENSSL_LIB_DIR=/usr/lib/$cross_gnu" "${cross_var}_OPENSSL_INCLUDE_DIR=/usr/include"
fi
unset cross_var cross_lower cross_package host_target
