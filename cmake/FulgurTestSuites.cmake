# fulgur_add_test_suites(<target> LABELS <labels...> TIMEOUT <seconds>)
#
# Registers a GoogleTest binary with CTest as one test per test suite
# (`--gtest_filter=Suite.*`) instead of one per test: every test process
# first loads and initialises LibTorch (0.3 s to over 1 s here, more than most
# unit tests take), so 540 processes cost minutes of a suite run that ~60 do
# not. A suite's tests still run in order, each reported by GoogleTest in the
# output, and a failure names the test. Tests named *_CUDA get an entry of
# their own (label `cuda`), so that a machine without a GPU reports them as
# skipped and `ctest -L cuda` runs exactly them.
#
# The list is read from the binary after each build (as gtest_discover_tests
# does) by FulgurTestSuitesList.cmake.
function(fulgur_add_test_suites target)
  cmake_parse_arguments(ARG "" "TIMEOUT" "LABELS" ${ARGN})
  set(ctest_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_suites.cmake")
  string(REPLACE ";" "," labels "${ARG_LABELS}")
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND}
            -DEXECUTABLE=$<TARGET_FILE:${target}>
            -DWORKING_DIRECTORY=${CMAKE_CURRENT_BINARY_DIR}
            -DOUTPUT=${ctest_file}
            -DLABELS=${labels}
            -DTIMEOUT=${ARG_TIMEOUT}
            -P ${PROJECT_SOURCE_DIR}/cmake/FulgurTestSuitesList.cmake
    BYPRODUCTS ${ctest_file}
    VERBATIM)
  # Before the first build the list does not exist yet: say so, as a test.
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${target}_include.cmake")
  file(WRITE ${include_file}
    "if(EXISTS [==[${ctest_file}]==])\n"
    "  include([==[${ctest_file}]==])\n"
    "else()\n"
    "  add_test([==[${target}_NOT_BUILT]==] [==[${target}_NOT_BUILT]==])\n"
    "endif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${include_file})
endfunction()
