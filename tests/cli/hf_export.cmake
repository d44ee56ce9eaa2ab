# The --export-hf file is what Hugging Face transformers expects: pretrain_gpt trains a tiny
# GPT-2, a tiny Llama (GQA, untied head), a tiny Llama with QK-norm (tied head), with QK-norm
# and a sliding window of 8 tokens (of 32), with the window alone, and with 4 experts (top
# 2) and the window, exports, and transformers' GPT2LMHeadModel / LlamaForCausalLM /
# Qwen3ForCausalLM (twice) / MistralForCausalLM / MixtralForCausalLM (window and experts per
# token from the file's metadata), loaded with the file's names, give the same val loss as
# dtrain's evaluation (within 5e-5). Skipped when python3 cannot import transformers (scripts/setup.sh
# installs it).
#   -DPRETRAIN=<pretrain_gpt> -DPREPARE=<prepare_data> -DPYTHON=<python3> -DSOURCE_DIR=<repo> -DWORK_DIR=<dir>
file(REMOVE_RECURSE "${WORK_DIR}")
execute_process(COMMAND "${PYTHON}" -c "import transformers" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(NOT rc EQUAL 0)
  message(STATUS "skipped: python3 cannot import transformers")
  # CTest marks the test skipped on this output (SKIP_REGULAR_EXPRESSION).
  message(STATUS "DTRAIN_TEST_SKIPPED")
  return()
endif()
execute_process(COMMAND "${PREPARE}" --input "${SOURCE_DIR}/LICENSE" --output-dir "${WORK_DIR}/data" --name lic
                RESULT_VARIABLE rc OUTPUT_QUIET)
set(failures 0)
foreach(case gpt2 llama qwen3 qwen3_window mistral mixtral)
  string(REGEX REPLACE "_window$" "" family "${case}")
  set(extra)
  set(kv 4)
  if(family STREQUAL "llama")
    set(extra --family llama --n-kv-head 2 --tie-embeddings false)
    set(kv 2)
  elseif(family STREQUAL "qwen3")  # Llama with QK-norm, tied head; a high lr moves the norm
    # weights well away from 1 (with uniform weights, norming after RoPE would agree too)
    set(extra --family llama --n-kv-head 2 --qk-norm --lr 0.02)
    set(kv 2)
  elseif(family STREQUAL "mistral")  # Llama with a sliding window
    set(extra --family llama --n-kv-head 2 --attention-window 8)
    set(kv 2)
  elseif(family STREQUAL "mixtral")  # Llama with experts, and a sliding window
    set(extra --family llama --n-kv-head 2 --tie-embeddings false --moe-experts 4 --moe-topk 2 --attention-window 8)
    set(kv 2)
  endif()
  if(case STREQUAL "qwen3_window")
    list(APPEND extra --attention-window 8)
  endif()
  execute_process(COMMAND "${PRETRAIN}" --train-data "${WORK_DIR}/data/lic_train_*.bin"
                          --val-data "${WORK_DIR}/data/lic_val_*.bin" --progress off --steps 20 --warmup-steps 2
                          --seq-len 32 --global-batch 8 --eval-batches 2 ${extra}
                          --export-hf "${WORK_DIR}/${case}.safetensors"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 300)
  string(REGEX MATCH "done: [^\n]*val loss ([0-9.]+)" m "${out}${err}")
  set(dtrain_loss "${CMAKE_MATCH_1}")
  set(ok FALSE)
  if(rc EQUAL 0 AND NOT dtrain_loss STREQUAL "")
    execute_process(COMMAND "${PYTHON}" "${SOURCE_DIR}/tests/python/hf_export_check.py" "${WORK_DIR}/${case}.safetensors"
                            ${family} "${WORK_DIR}/data/lic_val_000000.bin" 32 8 2 64 2 4 ${kv} 64 ${dtrain_loss}
                    RESULT_VARIABLE prc OUTPUT_VARIABLE pout ERROR_VARIABLE perr TIMEOUT 300)
    string(REGEX MATCH "hf val loss ([0-9.]+)" m "${pout}")
    set(hf_loss "${CMAKE_MATCH_1}")
    if(prc EQUAL 0)
      set(ok TRUE)
    endif()
  endif()
  if(ok)
    message(STATUS "ok: ${case}: dtrain val loss ${dtrain_loss}, transformers ${hf_loss}")
  else()
    message(STATUS "FAILED: ${case}: dtrain '${dtrain_loss}' (exit ${rc}), transformers '${hf_loss}' (exit ${prc}):\n${pout}${perr}")
    math(EXPR failures "${failures} + 1")
  endif()
endforeach()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} export check(s) failed")
endif()
