# Shared settings of fulgur's own targets: warnings and the precompiled
# LibTorch headers. One PCH is built once (fulgur_pch) and reused by the
# library, the examples, the tools and the benchmarks; the test programs have
# their own (fulgur_test_pch), built as they are compiled (below).

set(FULGUR_WARNING_FLAGS -Wall -Wextra -Wpedantic -Winvalid-pch)
# GCC 12 to 14 report out-of-bounds memcpy inside libstdc++'s std::string
# when a literal is prepended to a temporary string ("a" + std::string(...)),
# an operation that cannot overflow: GCC bugs 105329, 105651 and 107138
# (-Warray-bounds, -Wstringop-overflow, -Wrestrict at -O2). They moved from file to file
# between 12 and 14, so they are off for those compilers rather than worked
# around at each call.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
   AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 15)
  list(APPEND FULGUR_WARNING_FLAGS -Wno-array-bounds -Wno-stringop-overflow -Wno-restrict)
endif()
if(FULGUR_WERROR)
  list(APPEND FULGUR_WARNING_FLAGS -Werror)
endif()

# Test programs (the test binaries and their worker processes) are compiled
# without optimisation when FULGUR_UNOPTIMIZED_TESTS is on (the default): two
# thirds of a test source's compile time is GCC optimising the LibTorch
# templates it instantiates (-ftime-report), and -O0 halves it (a unit-test
# batch: 64 -> 35 s; the multi-process tests: 47 -> 21 s), while the tests'
# run time is spent in the library and LibTorch, which stay optimised.
set(FULGUR_TEST_OPTIMIZATION_FLAGS)
if(FULGUR_UNOPTIMIZED_TESTS AND NOT CMAKE_BUILD_TYPE STREQUAL "Debug")
  set(FULGUR_TEST_OPTIMIZATION_FLAGS -O0)
endif()

if(FULGUR_USE_PCH)
  add_library(fulgur_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
  target_link_libraries(fulgur_pch PRIVATE torch)
  target_compile_options(fulgur_pch PRIVATE ${FULGUR_WARNING_FLAGS})
  target_precompile_headers(fulgur_pch PRIVATE ${PROJECT_SOURCE_DIR}/cmake/pch.h)
  # A PCH is used only with the optimisation level it was built with
  # (__OPTIMIZE__), so the test programs get their own.
  if(FULGUR_TEST_OPTIMIZATION_FLAGS)
    add_library(fulgur_test_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
    target_link_libraries(fulgur_test_pch PRIVATE torch)
    target_compile_options(fulgur_test_pch PRIVATE ${FULGUR_WARNING_FLAGS}
                                                   ${FULGUR_TEST_OPTIMIZATION_FLAGS})
    target_precompile_headers(fulgur_test_pch PRIVATE ${PROJECT_SOURCE_DIR}/cmake/pch.h)
  endif()
endif()

# fulgur_target_defaults(<target> [TEST]): warnings and the shared precompiled
# header; with TEST, a test program's optimisation level and PCH (above).
function(fulgur_target_defaults target)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "TEST" "" "")
  target_compile_options(${target} PRIVATE ${FULGUR_WARNING_FLAGS})
  set(pch fulgur_pch)
  if(ARG_TEST AND FULGUR_TEST_OPTIMIZATION_FLAGS)
    target_compile_options(${target} PRIVATE ${FULGUR_TEST_OPTIMIZATION_FLAGS})
    set(pch fulgur_test_pch)
  endif()
  if(FULGUR_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM ${pch})
    # The PCH is built with -fPIC; executables would get -fPIE, which GCC
    # rejects for a PCH built with -fPIC (-Winvalid-pch reports it).
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      target_compile_options(${target} PRIVATE -fPIC)
    endif()
  endif()
endfunction()
