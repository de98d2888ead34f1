# The Arm cross build's test runs under qemu-aarch64; included by tests/CMakeLists.txt
# when cross-compiling. qemu enforces CPU features (an instruction the emulated CPU lacks raises
# SIGILL), so each kernel set runs on the smallest CPU that has its features, which also tests
# the feature detection. QEMU_CPU picks the emulated CPU per test.
#
# Emulation runs about 1e9 int8 MAC/s, so the library suite runs nearly in full for the best set
# only (less the original grid's largest shapes, H = 2048, and the suites that check the
# scheme, the test harness or the conversions rather than a kernel set: they run on x86), and
# reduced to the forward grid, threads, special rows and the int8 linear layer (two int4 planes
# through each set's GEMM) for the others.
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

# Registers the library suite for kernel set `isa` on emulated CPU `cpu` with a gtest filter.
function(w4a8moe_emulated_suite isa cpu filter)
  gtest_discover_tests(w4a8moe_tests DISCOVERY_TIMEOUT 300 TEST_PREFIX "${isa}@${cpu}."
                       NO_PRETTY_VALUES TEST_FILTER "${filter}"
                       PROPERTIES ENVIRONMENT "W4A8MOE_ISA=${isa}"
                                  ENVIRONMENT_MODIFICATION "QEMU_CPU=set:${cpu}")
endfunction()

set(W4A8MOE_ARM_FULL "-*H2048*:ForwardFloatReference.*:ComparisonRejects.*:Numerics.*")
set(W4A8MOE_ARM_REDUCED "Forward/*:Cases/*:SpecialRows.*:LinearInt8/*:LinearInt8.*:\
-*H2048*:Forward/OriginalGrid.*_f16:Forward/OriginalGrid.*_bf16:*T300*")
set(W4A8MOE_ARM_SMALL "Forward/OriginalGrid.*_f32:SpecialRows.*:-*H2048*")
# Each kernel set of the build (W4A8MOE_KERNEL_SETS) on its emulated CPU, the smallest with its
# features, with its filter: set|cpu|filter.
set(W4A8MOE_ARM_RUNS "neoni8mm|max|${W4A8MOE_ARM_FULL}"
                     "neondot|neoverse-n1|${W4A8MOE_ARM_REDUCED}"
                     "neon|cortex-a53|${W4A8MOE_ARM_REDUCED}"
                     "scalar|cortex-a53|${W4A8MOE_ARM_SMALL}")
set(W4A8MOE_ARM_UNRUN ${W4A8MOE_KERNEL_SETS})
foreach(run IN LISTS W4A8MOE_ARM_RUNS)
  string(REPLACE "|" ";" parts "${run}")
  list(GET parts 0 isa)
  list(GET parts 1 cpu)
  list(GET parts 2 filter)
  w4a8moe_emulated_suite(${isa} ${cpu} "${filter}")
  list(REMOVE_ITEM W4A8MOE_ARM_UNRUN ${isa})
endforeach()
if(W4A8MOE_ARM_UNRUN)
  message(FATAL_ERROR "tests/arm/emulated_tests.cmake: no emulated CPU for ${W4A8MOE_ARM_UNRUN}")
endif()

# Detection, negative: a suite capped at a set the CPU lacks must skip (tests/isa_guard.cpp),
# and the registry-generated kernel tests (one suite per set; a set the CPU lacks skips) must
# not die of SIGILL.
set(W4A8MOE_ARM_ONE "SpecialRows.*")
w4a8moe_emulated_suite(neondot cortex-a53 "${W4A8MOE_ARM_ONE}")
w4a8moe_emulated_suite(neoni8mm neoverse-n1 "${W4A8MOE_ARM_ONE}")
foreach(cpu cortex-a53 neoverse-n1)
  gtest_discover_tests(w4a8moe_kernel_tests DISCOVERY_TIMEOUT 300 TEST_PREFIX "${cpu}."
                       NO_PRETTY_VALUES PROPERTIES ENVIRONMENT_MODIFICATION "QEMU_CPU=set:${cpu}")
endforeach()

# Detection, positive: each CPU offers exactly the sets it has the features for.
if(TARGET w4a8moe_cli)
  foreach(expect "cortex-a53:neon, scalar" "neoverse-n1:neondot, neon, scalar"
                 "max:neoni8mm, neondot, neon, scalar")
    string(REPLACE ":" ";" parts "${expect}")
    list(GET parts 0 cpu)
    list(GET parts 1 sets)
    add_test(NAME arm.${cpu}.DetectsItsKernelSets COMMAND w4a8moe_cli check)
    set_tests_properties(arm.${cpu}.DetectsItsKernelSets PROPERTIES
                         ENVIRONMENT "QEMU_CPU=${cpu}"
                         PASS_REGULAR_EXPRESSION "kernel sets: ${sets}\n")
  endforeach()
endif()

# The program under qemu reproduces the x86 program's results: needs an x86 build of the same
# tree (-DW4A8MOE_HOST_BUILD_DIR=..., as scripts/test.sh passes).
set(W4A8MOE_HOST_BUILD_DIR "" CACHE PATH
    "x86 build of this tree whose w4a8moe the Arm program is compared with")
if(TARGET w4a8moe_cli AND W4A8MOE_HOST_BUILD_DIR)
  set(script ${CMAKE_CURRENT_LIST_DIR}/run_vs_x86.sh)
  set(work ${CMAKE_CURRENT_BINARY_DIR}/run_vs_x86)
  add_test(NAME arm.RunVsX86.prepare COMMAND sh ${script} prepare ${W4A8MOE_HOST_BUILD_DIR} ${work})
  set_tests_properties(arm.RunVsX86.prepare PROPERTIES FIXTURES_SETUP w4a8moe_x86_cases)
  foreach(run IN LISTS W4A8MOE_ARM_RUNS)
    string(REPLACE "|" ";" parts "${run}")
    list(GET parts 0 isa)
    list(GET parts 1 cpu)
    add_test(NAME ${isa}@${cpu}.RunVsX86
             COMMAND sh ${script} check ${W4A8MOE_HOST_BUILD_DIR} ${work} ${isa}
                     ${CMAKE_CROSSCOMPILING_EMULATOR} $<TARGET_FILE:w4a8moe_cli>)
    set_tests_properties(${isa}@${cpu}.RunVsX86 PROPERTIES FIXTURES_REQUIRED w4a8moe_x86_cases
                         ENVIRONMENT "W4A8MOE_ISA=${isa}"
                         ENVIRONMENT_MODIFICATION "QEMU_CPU=set:${cpu}")
  endforeach()
else()
  message(STATUS "w4a8moe: no W4A8MOE_HOST_BUILD_DIR: the Arm program is not compared with x86")
endif()

# Tests whose measurement is of the emulator, not of the code: disabled in the emulated build.
#   LayerCli.LoadingStreams  bounds the program's peak resident memory, which under qemu-user
#                            includes the emulator's own (its translation cache, about 15 MiB).
set(W4A8MOE_ARM_NOT_EMULATED LayerCli.LoadingStreams)
# (Run by CTest after the discovered tests are defined; a name that no longer exists is ignored.)
file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/w4a8moe_not_emulated.cmake
     "set_tests_properties(${W4A8MOE_ARM_NOT_EMULATED} PROPERTIES DISABLED TRUE)\n")
set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES
             ${CMAKE_CURRENT_BINARY_DIR}/w4a8moe_not_emulated.cmake)
