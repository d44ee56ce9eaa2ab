# A short pretraining run as the demo does it: 2 MPI ranks, the bundled fortunes corpus,
# the tiny config for 100 steps. The loss must fall by at least 2.0 nats (measured: from
# 5.55, ln 256, to 3.23; val 3.16) and the val loss must end below 3.6.
#   -DPRETRAIN=... -DPREPARE=... -DMPIEXEC=... -DSOURCE_DIR=... -DWORK_DIR=...
execute_process(COMMAND bash "${SOURCE_DIR}/scripts/prepare_corpus.sh" "${PREPARE}" "${WORK_DIR}/data"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "preparing the corpus failed (${rc})")
endif()
file(REMOVE "${WORK_DIR}/metrics.jsonl")
execute_process(
  COMMAND "${MPIEXEC}" -np 2 --oversubscribe "${PRETRAIN}"
          --config "${SOURCE_DIR}/examples/configs/tiny.json" --steps 100 --eval-every 0
          --train-data "${WORK_DIR}/data/fortunes_train_*.bin"
          --val-data "${WORK_DIR}/data/fortunes_val_*.bin"
          --metrics "${WORK_DIR}/metrics.jsonl" --progress off
  RESULT_VARIABLE rc TIMEOUT 300)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "pretrain_gpt exited with ${rc}")
endif()
file(STRINGS "${WORK_DIR}/metrics.jsonl" lines)
list(LENGTH lines n)
if(NOT n EQUAL 100)
  message(FATAL_ERROR "metrics file has ${n} lines, want 100")
endif()
list(GET lines 0 first)
list(GET lines -1 last)
string(JSON first_loss GET "${first}" loss)
string(JSON last_loss GET "${last}" loss)
string(JSON val_loss GET "${last}" val_loss)
message(STATUS "loss ${first_loss} -> ${last_loss}, val loss ${val_loss}")
foreach(v first_loss last_loss val_loss)
  string(REGEX REPLACE "^([0-9]+)\\.([0-9][0-9]).*" "\\1\\2" ${v}_c "${${v}}")
endforeach()
math(EXPR drop "${first_loss_c} - ${last_loss_c}")
if(drop LESS 200)
  message(FATAL_ERROR "the loss fell by only 0.${drop} (x100: ${drop}); want at least 2.00")
endif()
if(val_loss_c GREATER_EQUAL 360)
  message(FATAL_ERROR "final val loss ${val_loss} is not below 3.6")
endif()
