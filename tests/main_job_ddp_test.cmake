# The main job goes multi-process: the Fashion-MNIST example trained for the
# same 150 optimizer steps on one process (batch 128) and on two ranks
# (batch 64 each) under `ddp`, `ddp_fork`, `fsdp_shard_grad_op` and `fsdp` (the example
# declares its two large layers as FSDPUnit) reaches the same test accuracy
# on the full 10,000-image test set (within 2 points; BatchNorm statistics
# are per rank, so not bit-identical). Each run is bounded in time.
# Run with -DEXAMPLE=<fashion_mnist binary> -DWORK_DIR=<scratch directory>.
set(common --max_steps 150 --limit_val_batches 0 --enable_progress_bar false --seed 42)

function(train name out_var)
  set(dir ${WORK_DIR}/${name})
  file(REMOVE_RECURSE ${dir})
  file(MAKE_DIRECTORY ${dir})
  execute_process(COMMAND ${EXAMPLE} ${common} ${ARGN}
                  WORKING_DIRECTORY ${dir}
                  OUTPUT_VARIABLE output ERROR_VARIABLE output
                  RESULT_VARIABLE rc TIMEOUT 240)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} (${EXAMPLE} ${common} ${ARGN}) failed (${rc}):\n${output}")
  endif()
  if(NOT output MATCHES "test_acc=([0-9.]+)")
    message(FATAL_ERROR "${name} printed no test_acc=:\n${output}")
  endif()
  message(STATUS "${name}: test_acc=${CMAKE_MATCH_1}")
  set(${out_var} ${CMAKE_MATCH_1} PARENT_SCOPE)
endfunction()

# Accuracies as integers in 1/10000 (CMake's math() has no floats).
function(to_basis_points value out_var)
  string(REGEX REPLACE "^0\\.([0-9][0-9][0-9][0-9]).*$" "\\1" digits "${value}")
  math(EXPR points "1${digits} - 10000")
  set(${out_var} ${points} PARENT_SCOPE)
endfunction()

train(one_process single --batch_size 128 --devices 1)
to_basis_points(${single} single_bp)
if(single_bp LESS 8000)
  message(FATAL_ERROR "one process reached test_acc=${single} after 150 steps (expected >= 0.80)")
endif()
foreach(strategy ddp ddp_fork fsdp_shard_grad_op fsdp)
  train(${strategy} multi --batch_size 64 --devices 2 --strategy ${strategy})
  to_basis_points(${multi} multi_bp)
  math(EXPR diff "${multi_bp} - ${single_bp}")
  if(diff LESS -200 OR diff GREATER 200)
    message(FATAL_ERROR "--strategy ${strategy} --devices 2 reached test_acc=${multi}, one "
                        "process ${single}: more than 0.02 apart")
  endif()
endforeach()
