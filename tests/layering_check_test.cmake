# Checks scripts/check-layering.sh itself: on tests/layering/ (one upward
# include of each rule, beside allowed ones) it fails and names each
# offending include by file and line, and nothing else.
#   cmake -DSCRIPT=scripts/check-layering.sh -DFIXTURE=tests/layering -P tests/layering_check_test.cmake
execute_process(COMMAND bash ${SCRIPT} ${FIXTURE}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "check-layering.sh passed on ${FIXTURE}, which has upward includes:\n${out}${err}")
endif()
set(expected
  "include/fulgur/core/low.h:5: core/ includes fulgur/trainer/trainer.h"
  "include/fulgur/distributed/runtime.h:4: distributed/ includes fulgur/core/module.h"
  "include/fulgur/distributed/runtime.h:6: distributed/ includes fulgur/strategies/strategy.h"
  "src/strategies/policy.cpp:4: strategies/ includes trainer/trainer_impl.h")
foreach(line IN LISTS expected)
  string(FIND "${out}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "check-layering.sh did not report \"${line}\":\n${out}${err}")
  endif()
endforeach()
string(REGEX MATCHALL "\n  [^\n]+" reported "${out}")
list(LENGTH reported n)
list(LENGTH expected n_expected)
if(NOT n EQUAL n_expected)
  message(FATAL_ERROR "check-layering.sh reported ${n} includes, expected ${n_expected}:\n${out}${err}")
endif()
