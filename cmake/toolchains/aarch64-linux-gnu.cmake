# Cross build for AArch64 Linux with Debian's g++-aarch64-linux-gnu; CTest runs the programs under
# qemu-aarch64 (Debian's qemu-user). The emulated CPU is chosen per test with QEMU_CPU (the
# default, "max", has every feature), e.g.
#   cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/toolchains/aarch64-linux-gnu.cmake \
#         -DW4A8MOE_BUILD_BENCH=OFF
#   cmake --build build-aarch64 -j && ctest --test-dir build-aarch64
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(W4A8MOE_CROSS_TRIPLE aarch64-linux-gnu)
set(CMAKE_C_COMPILER ${W4A8MOE_CROSS_TRIPLE}-gcc)
set(CMAKE_CXX_COMPILER ${W4A8MOE_CROSS_TRIPLE}-g++)
set(W4A8MOE_CROSS_SYSROOT /usr/${W4A8MOE_CROSS_TRIPLE})

find_program(W4A8MOE_QEMU qemu-aarch64)
if(W4A8MOE_QEMU)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${W4A8MOE_QEMU} -L ${W4A8MOE_CROSS_SYSROOT})
endif()

# Libraries from the target's directories only; header-only packages (nlohmann-json, CLI11) and
# their CMake files from the host's as well. GoogleTest is built from /usr/src/googletest.
set(CMAKE_FIND_ROOT_PATH ${W4A8MOE_CROSS_SYSROOT})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
