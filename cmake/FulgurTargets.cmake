# Shared settings of fulgur's own targets: warnings and the precompiled
# LibTorch headers. One PCH is built once (fulgur_pch) and reused by the
# library, the tests, the examples and the benchmarks.

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

if(FULGUR_USE_PCH)
  add_library(fulgur_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
  target_link_libraries(fulgur_pch PRIVATE torch)
  target_compile_options(fulgur_pch PRIVATE ${FULGUR_WARNING_FLAGS})
  target_precompile_headers(fulgur_pch PRIVATE ${PROJECT_SOURCE_DIR}/cmake/pch.h)
endif()

# fulgur_target_defaults(<target>): warnings and the shared precompiled header.
function(fulgur_target_defaults target)
  target_compile_options(${target} PRIVATE ${FULGUR_WARNING_FLAGS})
  if(FULGUR_USE_PCH)
    target_precompile_headers(${target} REUSE_FROM fulgur_pch)
    # The PCH is built with -fPIC; executables would get -fPIE, which GCC
    # rejects for a PCH built with -fPIC (-Winvalid-pch reports it).
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      target_compile_options(${target} PRIVATE -fPIC)
    endif()
  endif()
endfunction()
