# Shared settings of fulgur's own targets: warnings and the precompiled
# LibTorch headers. One PCH is built once (fulgur_pch) and reused by the
# library, the tests, the examples and the benchmarks.

set(FULGUR_WARNING_FLAGS -Wall -Wextra -Wpedantic -Winvalid-pch)
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
