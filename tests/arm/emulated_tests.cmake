# The Arm cross build's test runs under qemu-aarch64 (issue 4); included by tests/CMakeLists.txt
# when cross-compiling. qemu enforces CPU features (an instruction the emulated CPU lacks raises
# SIGILL), so each kernel set runs on a CPU that has its features and no more, which also tests
# the feature detection. QEMU_CPU picks the emulated CPU per test.
if(NOT CMAKE_CROSSCOMPILING_EMULATOR)
  message(WARNING "cross build without CMAKE_CROSSCOMPILING_EMULATOR: tests are not runnable")
endif()

# w4a8moe-emulated: the program through the emulator, for tests that start it as a command.
if(TARGET w4a8moe_cli)
  list(JOIN CMAKE_CROSSCOMPILING_EMULATOR "' '" W4A8MOE_EMULATOR_QUOTED)
  file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/w4a8moe-emulated
       CONTENT "#!/bin/sh\nexec '${W4A8MOE_EMULATOR_QUOTED}' '$<TARGET_FILE:w4a8moe_cli>' \"$@\"\n"
       FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ GROUP_EXECUTE
                        WORLD_READ WORLD_EXECUTE)
endif()

# Kernel set, emulated CPU: each set on the smallest CPU that has its features.
set(W4A8MOE_ARM_RUNS scalar:cortex-a53 neon:cortex-a53 neondot:neoverse-n1 neoni8mm:max)
foreach(run ${W4A8MOE_ARM_RUNS})
  string(REPLACE ":" ";" parts ${run})
  list(GET parts 0 isa)
  list(GET parts 1 cpu)
  gtest_discover_tests(w4a8moe_tests DISCOVERY_TIMEOUT 300 TEST_PREFIX "${isa}@${cpu}."
                       NO_PRETTY_VALUES
                       PROPERTIES ENVIRONMENT "W4A8MOE_ISA=${isa}"
                                  ENVIRONMENT_MODIFICATION "QEMU_CPU=set:${cpu}")
endforeach()
