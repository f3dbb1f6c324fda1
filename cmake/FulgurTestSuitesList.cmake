# Writes the CTest entries of one GoogleTest binary, one per test suite (see
# FulgurTestSuites.cmake). Run by a POST_BUILD step:
#   cmake -DEXECUTABLE=<binary> -DWORKING_DIRECTORY=<dir> -DOUTPUT=<file>
#         -DLABELS=<a,b> -DTIMEOUT=<seconds> -P FulgurTestSuitesList.cmake
cmake_minimum_required(VERSION 3.22)  # policies, in script mode too
execute_process(COMMAND ${EXECUTABLE} --gtest_list_tests
                WORKING_DIRECTORY ${WORKING_DIRECTORY}
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors
                RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc EQUAL 0)
  file(REMOVE ${OUTPUT})
  message(FATAL_ERROR "${EXECUTABLE} --gtest_list_tests failed (${rc}):\n${listing}${errors}")
endif()

string(REPLACE "," ";" labels "${LABELS}")
# Bracket arguments, so that no name or path needs escaping.
macro(entry name filter entry_labels skip)
  string(APPEND script
    "add_test([==[${name}]==] [==[${EXECUTABLE}]==] [==[--gtest_filter=${filter}]==])\n"
    "set_tests_properties([==[${name}]==] PROPERTIES WORKING_DIRECTORY "
    "[==[${WORKING_DIRECTORY}]==] TIMEOUT ${TIMEOUT} LABELS [==[${entry_labels}]==]")
  if(${skip})
    # A test that calls GTEST_SKIP() (no GPU here) shows as skipped.
    string(APPEND script " SKIP_REGULAR_EXPRESSION [==[\\[  SKIPPED \\]]==]")
  endif()
  string(APPEND script ")\n")
endmacro()

set(script "# Generated from ${EXECUTABLE} --gtest_list_tests; do not edit.\n")
set(suite "")
set(suite_has_others FALSE)
macro(close_suite)
  if(NOT suite STREQUAL "" AND suite_has_others)
    entry("${suite}" "${suite}.*-${suite}.*_CUDA" "${labels}" FALSE)
  endif()
endmacro()

string(REPLACE "\n" ";" lines "${listing}")
foreach(line IN LISTS lines)
  string(REGEX REPLACE " *#.*$" "" line "${line}")  # "  # GetParam() = ..." comments
  if(line MATCHES "^([A-Za-z0-9_/]+)\\.$")
    close_suite()
    set(suite "${CMAKE_MATCH_1}")
    set(suite_has_others FALSE)
  elseif(line MATCHES "^  ([A-Za-z0-9_/]+)$")
    set(test "${CMAKE_MATCH_1}")
    if(test MATCHES "_CUDA$")
      set(cuda_labels ${labels} cuda)
      entry("${suite}.${test}" "${suite}.${test}" "${cuda_labels}" TRUE)
    else()
      set(suite_has_others TRUE)
    endif()
  endif()
endforeach()
close_suite()
file(WRITE ${OUTPUT} "${script}")
