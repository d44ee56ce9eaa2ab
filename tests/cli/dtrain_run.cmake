# dtrain-run as a user runs it: --dry-run prints the exact mpirun / srun command with the
# forwarded variables; bad input exits 2 naming the option. With MPI: a rank killed by
# fault injection is relaunched from the latest checkpoint and the run ends bit-identical
# to one that never failed; SIGUSR1 to dtrain-run reaches every rank, which save and exit
# 75, and --resume auto finishes the run. Run by CTest with:
#   -DRUN=<dtrain-run> -DPRETRAIN=<pretrain_gpt> -DPREPARE=<prepare_data> -DMPIEXEC=<mpirun or "">
#   -DSOURCE_DIR=<repo> -DWORK_DIR=<scratch dir>
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(failures 0)

function(check name ok output)
  if(ok)
    message(STATUS "ok: ${name}")
  else()
    message(STATUS "FAILED: ${name}:\n${output}")
    math(EXPR n "${failures} + 1")
    set(failures ${n} PARENT_SCOPE)
  endif()
endfunction()

# run(<out var> <rc var> ARGS...): dtrain-run with the given arguments (and environment).
macro(run out rc)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE ${rc} OUTPUT_VARIABLE _o ERROR_VARIABLE _e TIMEOUT 180)
  set(${out} "${_o}${_e}")
endmacro()

run(out rc ${CMAKE_COMMAND} -E env DTRAIN_LOG_LEVEL=debug NCCL_DEBUG=INFO
    "${RUN}" --dry-run -n 8 --hosts a:4,b:4 -- prog --flag "two words")
if(rc EQUAL 0 AND out MATCHES "^mpirun -np 8 --host a:4,b:4 --map-by numa --bind-to numa "
   AND out MATCHES "-x DTRAIN_LOG_LEVEL" AND out MATCHES "-x NCCL_DEBUG" AND out MATCHES "-x DTRAIN_RESTART_COUNT"
   AND out MATCHES "prog --flag 'two words'\n$")
  set(ok TRUE)
else()
  set(ok FALSE)
endif()
check(dry-run-mpirun ${ok} "${out}")

run(out rc "${RUN}" --dry-run --launcher srun -n 4 --gpus-per-node 4 --bind core --launcher-arg=--exclusive -- prog)
if(rc EQUAL 0 AND out STREQUAL "srun --ntasks 4 --export=ALL --cpu-bind=cores --gpus-per-node=4 --gpu-bind=closest --exclusive prog\n")
  set(ok TRUE)
else()
  set(ok FALSE)
endif()
check(dry-run-srun ${ok} "${out}")

foreach(bad "hosts;--hosts;a:x;entry 'a:x' is not allowed"
            "slots;-n;9;--hosts;a:4,b:4;-n 9 exceeds the 8 slots of --hosts 'a:4,b:4'"
            "srun-hosts;--launcher;srun;--hosts;a:2;--hosts / --hostfile are for mpirun"
            "launcher;--launcher;ssh;--launcher: ssh not in")
  list(GET bad 0 name)
  list(GET bad -1 want)
  list(SUBLIST bad 1 -1 args)
  list(REMOVE_AT args -1)
  run(out rc "${RUN}" --dry-run ${args} -- prog)
  if(rc EQUAL 2 AND out MATCHES "${want}")
    set(ok TRUE)
  else()
    set(ok FALSE)
  endif()
  check(bad-${name} ${ok} "exit ${rc}: ${out}")
endforeach()

if(MPIEXEC)
  execute_process(COMMAND "${PREPARE}" --input "${SOURCE_DIR}/LICENSE" --output-dir "${WORK_DIR}/data"
                          --name lic RESULT_VARIABLE rc OUTPUT_QUIET)
  set(TRAIN "${PRETRAIN}" --train-data "${WORK_DIR}/data/lic_train_*.bin" --progress off --seq-len 32
            --global-batch 8 --warmup-steps 1 --save-every 2)
  set(LAUNCH "${RUN}" -n 2 --bind none --mpirun "${MPIEXEC}" --launcher-arg=--oversubscribe)

  # Rank 1 dies at step 5 (after the step-4 checkpoint); one restart finishes the run.
  run(out rc ${CMAKE_COMMAND} -E env DTRAIN_FAULT_KILL_RANK=1 DTRAIN_FAULT_AT_STEP=5
      ${LAUNCH} --max-restarts 2 -- ${TRAIN} --steps 6 --save-dir "${WORK_DIR}/faulty")
  if(rc EQUAL 0 AND out MATCHES "fault injection: rank 1 kills itself at step 5"
     AND out MATCHES "restarting from the latest good checkpoint \\(1 of 2\\)"
     AND out MATCHES "restart 1: .* --resume auto" AND out MATCHES "resumed from [^\n]*step_4 at step 4")
    set(ok TRUE)
  else()
    set(ok FALSE)
  endif()
  check(fault-restart ${ok} "exit ${rc}: ${out}")
  run(out rc ${LAUNCH} -- ${TRAIN} --steps 6 --save-dir "${WORK_DIR}/clean")
  file(READ "${WORK_DIR}/faulty/step_6/manifest.json" faulty)
  file(READ "${WORK_DIR}/clean/step_6/manifest.json" clean)
  set(ok TRUE)
  foreach(f rank_00000.safetensors rank_00001.safetensors)
    string(JSON a ERROR_VARIABLE err GET "${faulty}" files ${f} checksum)
    string(JSON b ERROR_VARIABLE err GET "${clean}" files ${f} checksum)
    if(NOT a STREQUAL b OR a STREQUAL "")
      set(ok FALSE)
    endif()
  endforeach()
  check(fault-restart-equals-uninterrupted ${ok} "checksums differ:\n${faulty}\n${clean}")

  # SIGUSR1 to dtrain-run: forwarded by mpirun to the ranks; they save and exit 75.
  set(log "${WORK_DIR}/preempt.log")
  list(JOIN LAUNCH "' '" launch)
  list(JOIN TRAIN "' '" train)
  file(WRITE "${WORK_DIR}/preempt.sh" "'${launch}' -- '${train}' --steps 100000 --save-dir '${WORK_DIR}/preempt' > '${log}' 2>&1 &
p=$!
i=0
while [ $i -lt 600 ] && ! grep -q 'step     3/' '${log}'; do sleep 0.1; i=$((i+1)); done
kill -USR1 $p
wait $p
echo rc=$?
")
  execute_process(COMMAND sh "${WORK_DIR}/preempt.sh" OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 180)
  file(READ "${log}" text)
  file(GLOB saved "${WORK_DIR}/preempt/step_*")
  if(out MATCHES "rc=75" AND text MATCHES "preempted \\(a preemption signal\\): stopped after step" AND saved)
    set(ok TRUE)
  else()
    set(ok FALSE)
  endif()
  check(sigusr1-preempts ${ok} "${out}\n${text}")
endif()

if(failures GREATER 0)
  message(FATAL_ERROR "${failures} dtrain-run check(s) failed")
endif()
