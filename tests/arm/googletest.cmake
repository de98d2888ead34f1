# GoogleTest for the target of a cross build, compiled from Debian's sources (package
# googletest) instead of multiarch binary packages. Included by tests/CMakeLists.txt.
set(W4A8MOE_GTEST_SOURCE_DIR /usr/src/googletest CACHE PATH
    "GoogleTest sources compiled for the target of a cross build")
if(NOT EXISTS ${W4A8MOE_GTEST_SOURCE_DIR}/CMakeLists.txt)
  message(FATAL_ERROR "cross build: no GoogleTest sources in ${W4A8MOE_GTEST_SOURCE_DIR} "
                      "(apt-get install googletest, or set W4A8MOE_GTEST_SOURCE_DIR)")
endif()
set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
set(BUILD_GMOCK ON CACHE BOOL "" FORCE)
add_subdirectory(${W4A8MOE_GTEST_SOURCE_DIR} ${CMAKE_BINARY_DIR}/googletest EXCLUDE_FROM_ALL)
foreach(lib gtest gtest_main gmock gmock_main)
  # Headers as system headers, as with the packaged library: our warning flags are not theirs.
  target_compile_options(${lib} PRIVATE -w)  # third-party code: its warnings are not ours
  get_target_property(dirs ${lib} INTERFACE_INCLUDE_DIRECTORIES)
  set_target_properties(${lib} PROPERTIES INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${dirs}")
  if(NOT TARGET GTest::${lib})
    add_library(GTest::${lib} ALIAS ${lib})
  endif()
endforeach()
