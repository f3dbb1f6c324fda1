# Checks that an installed fulgur works from another project:
#   1. cmake --install <BUILD_DIR> --prefix <WORK_DIR>/prefix, and run the
#      installed `fulgur resolve`
#   2. configure <SOURCE_DIR> (tests/downstream) with CMAKE_PREFIX_PATH=<WORK_DIR>/prefix
#   3. build it
#   4. run <WORK_DIR>/build/downstream
# Any failing step stops the script with its command and full output.
#
#   cmake -DBUILD_DIR=build -DSOURCE_DIR=tests/downstream \
#         -DWORK_DIR=build/tests/downstream_work -P tests/downstream_test.cmake
#
# Optional: -DCXX_COMPILER=<path> builds the downstream project with the same
# compiler as fulgur.
cmake_minimum_required(VERSION 3.22)

foreach(var BUILD_DIR SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "downstream_test.cmake: pass -D${var}=<path>.")
  endif()
endforeach()
if(NOT EXISTS "${SOURCE_DIR}/CMakeLists.txt")
  message(FATAL_ERROR "downstream_test.cmake: SOURCE_DIR=${SOURCE_DIR} has no CMakeLists.txt.")
endif()

# run_step(<name> [WORKING_DIRECTORY <dir>] COMMAND <command> <args>...)
function(run_step name)
  cmake_parse_arguments(PARSE_ARGV 1 STEP "" "WORKING_DIRECTORY" "COMMAND")
  if(NOT STEP_WORKING_DIRECTORY)
    set(STEP_WORKING_DIRECTORY "${WORK_DIR}")
  endif()
  string(REPLACE ";" " " printable "${STEP_COMMAND}")
  message(STATUS "downstream: ${name}: ${printable}")
  execute_process(COMMAND ${STEP_COMMAND}
                  WORKING_DIRECTORY "${STEP_WORKING_DIRECTORY}"
                  RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT "${rc}" STREQUAL "0")
    message(FATAL_ERROR
      "downstream: ${name} failed (exit status: ${rc})\n"
      "command: ${printable}\n"
      "--- stdout ---\n${out}\n"
      "--- stderr ---\n${err}")
  endif()
  set(STEP_STDOUT "${out}" PARENT_SCOPE)
  set(STEP_STDERR "${err}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}" "${WORK_DIR}/run")

run_step(install COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")

# The `fulgur` program is installed with the library and runs from there.
run_step(installed_fulgur_resolve
         COMMAND "${WORK_DIR}/prefix/bin/fulgur" resolve --accelerator cpu --devices 2)
if(NOT STEP_STDOUT MATCHES "\"strategy\": \"ddp\"")
  message(FATAL_ERROR "downstream: the installed fulgur resolve printed:\n${STEP_STDOUT}")
endif()

set(configure_args
  -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G Ninja
  "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix"
  -DCMAKE_BUILD_TYPE=Release)
if(DEFINED CXX_COMPILER AND NOT "${CXX_COMPILER}" STREQUAL "")
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
run_step(configure COMMAND "${CMAKE_COMMAND}" ${configure_args})

run_step(build COMMAND "${CMAKE_COMMAND}" --build "${WORK_DIR}/build")

# Run in a scratch directory: the program may write logs or checkpoints to its
# working directory.
run_step(run WORKING_DIRECTORY "${WORK_DIR}/run" COMMAND "${WORK_DIR}/build/downstream")
message(STATUS "downstream: run output:\n${STEP_STDOUT}${STEP_STDERR}")
message(STATUS "downstream: find_package(fulgur) from an installed prefix works.")
