# pretrain_gpt as a user runs it: every kind of bad input exits with code 2 and a message
# naming the option, before training; --help documents the options; a JSON config is
# read and flags override it. Run by CTest with:
#   -DPRETRAIN=<pretrain_gpt> -DPREPARE=<prepare_data> -DMPIEXEC=<mpirun> -DSOURCE_DIR=<repo>
#   -DWORK_DIR=<scratch dir>
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
execute_process(COMMAND "${PREPARE}" --input "${SOURCE_DIR}/LICENSE" --output-dir "${WORK_DIR}/data"
                        --name lic RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "prepare_data failed (${rc})")
endif()
set(DATA --train-data "${WORK_DIR}/data/lic_train_*.bin" --val-data "${WORK_DIR}/data/lic_val_*.bin"
         --progress off)
set(failures 0)

# expect(<name> <exit code> <regex> [CPU] [NP n] ARGS ...); CPU: with no GPU visible
# (CUDA_VISIBLE_DEVICES empty), for a check of the CPU paths on a machine that has one.
function(expect name code regex)
  cmake_parse_arguments(E "CPU" "NP" "ARGS" ${ARGN})
  if(E_NP)
    set(cmd "${MPIEXEC}" -np ${E_NP} --oversubscribe "${PRETRAIN}" ${E_ARGS})
  else()
    set(cmd "${PRETRAIN}" ${E_ARGS})
  endif()
  if(E_CPU)
    set(cmd "${CMAKE_COMMAND}" -E env CUDA_VISIBLE_DEVICES= ${cmd})
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT 120)
  set(all "${out}${err}")
  set(last_output "${all}" PARENT_SCOPE)
  set(ok TRUE)
  if(code STREQUAL "nonzero")
    if(rc EQUAL 0)
      set(ok FALSE)
    endif()
  elseif(NOT rc EQUAL code)
    set(ok FALSE)
  endif()
  if(NOT all MATCHES "${regex}")
    set(ok FALSE)
  endif()
  if(ok)
    message(STATUS "ok: ${name}")
  else()
    message(STATUS "FAILED: ${name}: exit ${rc} (want ${code}), output must match '${regex}':\n${all}")
    math(EXPR n "${failures} + 1")
    set(failures ${n} PARENT_SCOPE)
  endif()
endfunction()

expect(help 0 "--config.*--preset.*--global-batch.*Data parallelism.*--bucket-mb" ARGS --help)
expect(unknown-flag nonzero "--no-such-flag" ARGS --no-such-flag 3 ${DATA})
expect(unknown-preset 2 "model preset 'gpt5' is not known; allowed: tiny, gpt2-124m" ARGS --preset gpt5 ${DATA})
expect(missing-data 2 "--train-data '[^']*nowhere_\\*.bin'.*no token shards match"
       ARGS --train-data "${WORK_DIR}/nowhere_*.bin" --progress off)
expect(seq-beyond-context 2 "--seq-len=100 is not allowed: the model context is 64" ARGS ${DATA} --seq-len 100)
expect(batch-not-divisible 2 "--global-batch=10 is not divisible by data-parallel size 1 x --micro-batch 4"
       ARGS ${DATA} --global-batch 10 --micro-batch 4)
expect(vocab-too-small 2 "holds token id [0-9]+ but the model's vocabulary is 50" ARGS ${DATA} --vocab-size 50)
expect(hybrid-without-dp-shard 2 "--fsdp hybrid needs --dp-shard N" ARGS ${DATA} --fsdp hybrid)
expect(fsdp-unknown 2 "--fsdp 'zero9' is not known; allowed: none, zero1, zero2, full, hybrid" ARGS ${DATA} --fsdp zero9)
expect(attention-unknown 2 "--attention=fast is not an attention backend; allowed: sdpa, flash" ARGS ${DATA} --attention fast)
expect(attention-window-negative 2 "attention_window=-3 \\(--attention-window\\) is out of range; allowed: 0"
       ARGS ${DATA} --attention-window -3)
expect(document-separator-range 2 "document_separator=256 \\(--document-separator\\) is out of range; allowed: -1 \\(none\\) or a token id in 0..255"
       ARGS ${DATA} --vocab-size 256 --document-separator 256)
expect(eod-mask-loss-without-documents 2 "--eod-mask-loss drops the loss at each document separator; allowed only with --document-separator ID \\(got -1\\)"
       ARGS ${DATA} --eod-mask-loss)
expect(reset-positions-without-documents 2 "reset_position_ids \\(--reset-position-ids\\) restarts positions at each document; allowed only with document_separator >= 0"
       ARGS ${DATA} --reset-position-ids)
# Every kernel option on the CPU (their reference paths) trains, with a sliding window and
# lines of the text as documents (the byte tokenizer's newline, 10) whose positions restart
# and whose separators get no loss.
expect(fused-ops-on-cpu 0 "device cpu.*kernels: attention flash, fused norm on, fused cross-entropy on, fused AdamW on.*context 64 \\(attention window 16\\) \\(documents end at token 10, positions restart, no loss at separators\\).*done: 5 steps" CPU ARGS ${DATA} --global-batch 8 --steps 5 --warmup-steps 1 --attention flash --fused-norm
       --fused-ce --fused-adamw --fsdp zero1 --attention-window 16 --document-separator 10 --reset-position-ids --eod-mask-loss)
# The same for Llama (SwiGLU, rotary embeddings with each document's own positions, GQA),
# with dropout (flash attention's on the probabilities among it) and Gemma 2's logit
# soft-capping; soft-capping without flash, or negative, is refused.
expect(fused-llama-on-cpu 0 "kernels: attention flash, fused norm on, fused cross-entropy on, fused AdamW on, fused SwiGLU on, fused RoPE on, fused linear cross-entropy on.*\\(attention softcap 20\\).*done: 5 steps" CPU
       ARGS ${DATA} --family llama --n-kv-head 2 --global-batch 8 --steps 5 --warmup-steps 1 --attention flash
       --fused-norm --fused-ce --fused-adamw --fused-swiglu --fused-rope --fused-linear-ce --document-separator 10
       --reset-position-ids --dropout 0.1 --attention-softcap 20)
expect(softcap-needs-flash 2 "attention_softcap=20 \\(--attention-softcap\\) needs --attention flash; got --attention sdpa"
       ARGS ${DATA} --attention sdpa --attention-softcap 20)
expect(softcap-negative 2 "attention_softcap=-1 \\(--attention-softcap\\) is out of range; allowed: 0 \\(none\\) or a finite cap > 0"
       ARGS ${DATA} --attention-softcap -1)
# Attention sinks (Megatron's --softmax-type): learned ones train on flash attention's
# reference path; any but vanilla without flash, or an unknown type, is refused.
expect(softmax-learnable 0 "\\(learnable softmax\\).*done: 3 steps" CPU
       ARGS ${DATA} --family llama --global-batch 8 --steps 3 --warmup-steps 1 --attention flash --softmax-type learnable)
expect(softmax-needs-flash 2 "softmax_type 'off-by-one' \\(--softmax-type\\) needs --attention flash; got --attention sdpa"
       ARGS ${DATA} --attention sdpa --softmax-type off-by-one)
# Local and global blocks (Megatron's --window-attn-skip-freq): logged with the window;
# without a window refused; exported with the warning (no class has per-layer windows).
expect(window-skip 0 "\\(attention window 8, global every 2 blocks\\).*done: 2 steps"
       ARGS ${DATA} --family llama --global-batch 8 --steps 2 --warmup-steps 1 --attention-window 8
            --window-attn-skip-freq 2 --export-hf "${WORK_DIR}/skip.safetensors")
expect(window-skip-needs-window 2 "window_skip_every=2 \\(--window-attn-skip-freq\\) is not allowed without --attention-window"
       ARGS ${DATA} --window-attn-skip-freq 2)
expect(softmax-unknown 2 "softmax_type 'softmax1' \\(--softmax-type\\) is not known; allowed: vanilla, off-by-one, learnable"
       ARGS ${DATA} --softmax-type softmax1)
# --deterministic (LibTorch's deterministic algorithms, which fail any op that has none,
# and flash attention's deterministic backward) trains a MoE Llama with dropout on 2 ranks
# (1 in a build without MPI) to the same losses as without it: the CPU paths are
# deterministic already, and the flag changes no arithmetic there.
set(DET_ARGS ${DATA} --family llama --n-kv-head 2 --global-batch 8 --steps 3 --warmup-steps 1 --attention flash
    --moe-experts 4 --moe-topk 2 --dropout 0.1)
set(DET_NP)
if(MPIEXEC)
  set(DET_NP NP 2)
endif()
expect(deterministic 0 "deterministic algorithms \\(bitwise-reproducible\\).*done: 3 steps" CPU ${DET_NP}
       ARGS ${DET_ARGS} --deterministic)
string(REGEX MATCH "done: [^\n]*" det_done "${last_output}")
expect(deterministic-off 0 "done: 3 steps" CPU ${DET_NP} ARGS ${DET_ARGS})
string(REGEX MATCH "done: [^\n]*" plain_done "${last_output}")
if(NOT det_done STREQUAL plain_done)
  message(STATUS "FAILED: deterministic-same-losses: '${det_done}' with --deterministic, '${plain_done}' without")
  math(EXPR failures "${failures} + 1")
endif()
expect(fused-on-and-off nonzero "--fused-ce excludes --no-fused-ce" ARGS ${DATA} --fused-ce --no-fused-ce)
expect(param-dtype-needs-fsdp 2 "--param-dtype / --reduce-dtype other than float32 need --fsdp"
       ARGS ${DATA} --param-dtype bfloat16)
expect(param-dtype-unknown 2 "--param-dtype 'fp8' is not known; allowed: float32, bfloat16, float16"
       ARGS ${DATA} --fsdp zero1 --param-dtype fp8)
expect(bad-choice 2 "--activation-checkpointing 'some' is not allowed; allowed: none, full, or a number of blocks N >= 1"
       ARGS ${DATA} --activation-checkpointing some)
expect(recompute-zero-blocks 2 "--activation-checkpointing '0' is not allowed" ARGS ${DATA} --activation-checkpointing 0)
expect(recompute-one-block 0 "step +2/2" ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --activation-checkpointing 1)

# A file that is not a token shard (magic and version errors: unit_train).
file(WRITE "${WORK_DIR}/text_000000.bin" "plain text, not a token shard\n")
expect(malformed-shard 2 "--val-data '[^']*text_000000.bin'.*token shard"
       ARGS ${DATA} --val-data "${WORK_DIR}/text_000000.bin")

# JSON config: an unknown key is named; flags override the file's values ...
file(WRITE "${WORK_DIR}/bad.json" "{\"preset\": \"tiny\", \"sequence\": 64}")
expect(config-unknown-key 2 "unknown key 'sequence'" ARGS --config "${WORK_DIR}/bad.json" ${DATA})
file(WRITE "${WORK_DIR}/run.json"
     "{\"preset\": \"tiny\", \"seq-len\": 32, \"global-batch\": 4, \"steps\": 3, \"warmup-steps\": 1}")
# ... and on the CPU the fused kernels default to off (on CUDA, to on).
expect(config-and-override 0 "steps=2.*kernels: attention sdpa, fused norm off, fused cross-entropy off, fused AdamW off.*done: 2 steps"
       CPU ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --metrics "${WORK_DIR}/m.jsonl")
file(STRINGS "${WORK_DIR}/m.jsonl" lines)
list(LENGTH lines nlines)
if(NOT nlines EQUAL 2)
  message(STATUS "FAILED: config-and-override wrote ${nlines} metrics lines, want 2")
  math(EXPR failures "${failures} + 1")
endif()

# Two ranks: the data-parallel size enters the divisibility check; all ranks exit 2.
if(MPIEXEC)
  expect(np2-zero2 0 "sharding: zero2 over 2 rank\\(s\\).*done: 2 steps"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --fsdp zero2)
  expect(np2-full 0 "sharding: full over 2 rank\\(s\\).*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --fsdp full)
  expect(np2-hybrid 0 "sharding: hybrid over 2 rank\\(s\\) \\(1 replicas x 2 shards\\).*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --fsdp hybrid --dp-shard 2)
  expect(np2-dp-shard-not-divisor 2 "--dp-shard=3 does not divide the data-parallel size 2"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --fsdp hybrid --dp-shard 3)
  expect(np2-batch-not-divisible 2 "--global-batch=3 is not divisible by data-parallel size 2"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --global-batch 3)
  # Tensor parallelism: the tp group reads the same samples (dp 1 here).
  expect(np2-tp-sp 0 "batch: 4 samples x 32 tokens per step = dp 1 .*tensor parallel: 2 ranks with sequence parallelism.*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --tp 2 --sequence-parallel --dropout 0.1)
  # The fused cross-entropy over the vocabulary split across --tp 2 (its reference path),
  # with PaLM's z-loss.
  expect(np2-tp-fused-ce 0 "tp=2.*z-loss=1e-4.*fused cross-entropy on.*done: 3 steps" CPU NP 2
         ARGS ${DATA} --global-batch 8 --steps 3 --warmup-steps 1 --tp 2 --fused-ce --z-loss 1e-4)
  # The fused linear cross-entropy over the split vocabulary (each rank's rows of the head),
  # with sequence parallelism.
  expect(np2-linear-ce-with-tp 0 "tp=2.*fused linear cross-entropy on.*done: 3 steps" CPU NP 2
         ARGS ${DATA} --global-batch 8 --steps 3 --warmup-steps 1 --tp 2 --sequence-parallel --fused-linear-ce)
  expect(np2-tp-fsdp 0 "tensor parallel: 2 ranks.*sharding: full over 1 rank.*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --tp 2 --fsdp full)
  expect(np2-tp-heads 2 "n_head=3 \\(--n-head\\) is not divisible by --tp=2"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --tp 2 --n-head 3 --d-model 48)
  expect(np2-tp-world 2 "tp x pp x cp = 3"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --tp 3)
  expect(np2-sp-seq 2 "--seq-len=31 is not divisible by --tp=2"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --tp 2 --sequence-parallel --seq-len 31)
  # Context parallelism: both ranks read the same samples and split each sequence.
  expect(np2-cp 0 "batch: 4 samples x 32 tokens per step = dp 1 .*context parallel: 2 ranks split each sequence, 16 positions per rank \\(2 chunks of 8\\).*gradients averaged over dp x cp = 2 rank\\(s\\).*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --cp 2 --document-separator 10 --eod-mask-loss)
  expect(np2-cp-seq 2 "--seq-len=30 cannot be split across --cp=2 .*allowed: a multiple of 4"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --cp 2 --seq-len 30)
  expect(np2-cp-flash 0 "attention window 12.*documents end at token 10.*context parallel: 2 ranks.*keys and values all-gathered per layer.*val loss"
         CPU NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --cp 2 --attention flash --document-separator 10
         --attention-window 12)
  expect(np2-cp-p2p 0 "context parallel: 2 ranks.*keys and values passed round the ring \\(p2p\\).*val loss"
         CPU NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --cp 2 --cp-comm p2p --attention flash)
  expect(np2-cp-p2p-documents 0 "attention window 12.*documents end at token 10.*keys and values passed round the ring \\(p2p\\).*val loss"
         CPU NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --cp 2 --cp-comm p2p --attention flash
         --document-separator 10 --attention-window 12)
  expect(np2-cp-p2p-sdpa 2 "--cp-comm p2p \\(ring attention\\) runs flash attention's passes on blocks of keys; got --attention sdpa.*allowed: --attention flash"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --cp 2 --cp-comm p2p)
  expect(np2-cp-a2a 0 "context parallel: 2 ranks.*heads exchanged for positions around attention \\(all-to-all\\).*val loss"
         CPU NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --cp 2 --cp-comm a2a --attention flash)
  expect(np2-pp-documents 0 "documents end at token 10.*pipeline: 2 stages x 1 chunk.*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --pp 2 --microbatches 2 --document-separator 10
         --eod-mask-loss)
  # Pipeline parallelism: 2 stages of the tiny model's 2 blocks, 2 micro-batches.
  expect(np2-pp 0 "pipeline: 2 stages x 1 chunk\\(s\\), schedule zb, 2 micro-batches of 2.*val loss.*trace: .*t.rank0.json"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --pp 2 --pp-schedule zb --microbatches 2
         --trace "${WORK_DIR}/t.json")
  # merge_traces joins the ranks' files and draws the last step (2 ranks x 2 micro-batches x
  # F, Bi, W = 12 actions).
  execute_process(COMMAND "${MERGE}" "${WORK_DIR}/all.json" "${WORK_DIR}/t.rank0.json" "${WORK_DIR}/t.rank1.json"
                          --svg "${WORK_DIR}/zb.svg" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0 AND out MATCHES "of 2 rank\\(s\\).*step 2: .*drew 12 pipeline actions" AND EXISTS "${WORK_DIR}/zb.svg")
    message(STATUS "ok: merge-traces")
  else()
    message(STATUS "FAILED: merge-traces: exit ${rc}:\n${out}${err}")
    math(EXPR failures "${failures} + 1")
  endif()
  execute_process(COMMAND "${MERGE}" "${WORK_DIR}/all.json" "${WORK_DIR}/t.rank7.json"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 2 AND err MATCHES "input '.*t.rank7.json' cannot be read")
    message(STATUS "ok: merge-traces-missing")
  else()
    message(STATUS "FAILED: merge-traces-missing: exit ${rc}:\n${out}${err}")
    math(EXPR failures "${failures} + 1")
  endif()
  expect(np2-trace-unwritable 2 "--trace '/nonexistent/t.json': this rank's file '/nonexistent/t.rank[01].json' cannot be written"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --pp 2 --trace /nonexistent/t.json)
  expect(np2-pp-fsdp 0 "pipeline: 2 stages x 1 chunk.*sharding: full over 1 rank.*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --pp 2 --fsdp full --microbatches 2)
  expect(np2-pp-fsdp-chunks 2 "--fsdp full with --virtual-stages 2 is not available"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --pp 2 --fsdp full --pp-schedule interleaved
         --virtual-stages 2 --n-layer 4 --microbatches 2)
  # Mixture of experts split over 2 ep ranks (bf16 autocast, recomputed blocks): the layout,
  # the telemetry line, JSON lines.
  expect(np2-moe 0 "moe: 2 layer\\(s\\) .* of 4 SwiGLU experts .*top-2 softmax routing, capacity factor 1.25.*ep 2: 2 experts per rank.*step +2: moe aux [0-9.]+ .*all-to-all [0-9.]+ MiB.*val loss"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --steps 2 --moe-experts 4 --ep 2 --moe-capacity 1.25
         --precision bf16 --activation-checkpointing full --metrics "${WORK_DIR}/moe.jsonl")
  file(READ "${WORK_DIR}/moe.jsonl" moe_lines)
  if(moe_lines MATCHES "\"moe\":{.*\"a2a_bytes\":[1-9].*\"dropped_fraction\".*\"tokens_per_expert\":\\[\\[")
    message(STATUS "ok: np2-moe-metrics")
  else()
    message(STATUS "FAILED: np2-moe-metrics: ${moe_lines}")
    math(EXPR failures "${failures} + 1")
  endif()
  expect(np2-moe-experts-ep 2 "--moe-experts=3 is not divisible by --ep=2"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --moe-experts 3 --ep 2)
  expect(np2-ep-dp 2 "--ep=2 does not divide the data-parallel size 1"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --moe-experts 4 --ep 2 --tp 2)
  expect(np2-ep-dense 2 "--ep=2 needs a MoE model \\(--moe-experts E\\)"
         NP 2 ARGS --config "${WORK_DIR}/run.json" ${DATA} --ep 2)
endif()
expect(moe-topk 2 "--moe-topk=5 is not allowed with --moe-experts 4; allowed: 1..4" ARGS ${DATA} --moe-experts 4 --moe-topk 5)
expect(moe-score 2 "--moe-score 'relu' is not known; allowed: softmax, sigmoid" ARGS ${DATA} --moe-experts 4 --moe-score relu)
expect(moe-dropless-capacity nonzero "--moe-capacity excludes --moe-dropless" ARGS ${DATA} --moe-experts 4 --moe-dropless --moe-capacity 2)
expect(pp-schedule-unknown 2 "--pp-schedule 'pipedream' is not known; allowed: gpipe, 1f1b, interleaved, zb"
       ARGS ${DATA} --pp-schedule pipedream)
expect(virtual-stages-without-pp 2 "--virtual-stages / --pp-layers need --pp > 1" ARGS ${DATA} --virtual-stages 2)
expect(sp-without-tp 2 "--sequence-parallel needs --tp > 1" ARGS ${DATA} --sequence-parallel)
expect(dropout-range 2 "dropout=1.5 is out of range" ARGS ${DATA} --dropout 1.5)
expect(z-loss-range 2 "z_loss=-0.001 \\(--z-loss\\) is out of range; allowed: a finite number >= 0" ARGS ${DATA} --z-loss -0.001)
# Checkpoint options.
expect(save-every-without-dir 2 "--save-every 5 needs --save-dir" ARGS ${DATA} --global-batch 8 --save-every 5)
expect(resume-auto-without-dir 2 "--resume auto needs --save-dir" ARGS ${DATA} --global-batch 8 --resume auto)
expect(resume-not-a-checkpoint 2 "--resume '[^']*data' is neither a checkpoint" ARGS ${DATA} --global-batch 8 --resume "${WORK_DIR}/data")
expect(max-skipped-steps 2 "--max-skipped-steps=0 must be >= 1" ARGS ${DATA} --global-batch 8 --max-skipped-steps 0)
expect(lr-negative 2 "--lr=-1 is not allowed; allowed: a finite learning rate > 0" ARGS ${DATA} --global-batch 8 --lr -1)
file(WRITE "${WORK_DIR}/not_a_dir" "")
expect(save-dir-is-file 2 "--save-dir '[^']*not_a_dir/ck': .*not_a_dir.* (exists but is not a directory|cannot be created)"
       ARGS ${DATA} --global-batch 8 --save-dir "${WORK_DIR}/not_a_dir/ck")
expect(keep-checkpoints 2 "--keep-checkpoints=-1 must be >= 0" ARGS ${DATA} --global-batch 8 --keep-checkpoints -1)
# Save at the end, then resume auto with more steps: it continues from step 3.
expect(save-at-end 0 "checkpoint: step 3 saved to [^\n]*ck/step_3" ARGS ${DATA} --global-batch 8 --steps 3 --warmup-steps 1 --save-dir "${WORK_DIR}/ck")
expect(resume-auto 0 "resumed from [^\n]*ck/step_3 at step 3.*step +5/5" ARGS ${DATA} --global-batch 8 --steps 5 --warmup-steps 1 --save-dir "${WORK_DIR}/ck" --resume auto)
expect(resume-done 0 "nothing to train, the run is at step 5 of --steps 5" ARGS ${DATA} --global-batch 8 --steps 5 --warmup-steps 1 --save-dir "${WORK_DIR}/ck" --resume auto)
# A data blend (Megatron's --data-path form) trains; a bad weight is named.
expect(blend 0 "data: blend 0.7 of each batch from '[^']*lic_train_\\*.bin'.*data: blend 0.3 of each batch from '[^']*lic_val_\\*.bin'.*step +2/2"
       ARGS --train-data "0.7 ${WORK_DIR}/data/lic_train_*.bin 0.3 ${WORK_DIR}/data/lic_val_*.bin" --progress off
            --global-batch 8 --steps 2 --warmup-steps 1)
expect(blend-bad-weight 2 "--train-data '[^']*': weight '-1' of '[^']*lic_val_\\*.bin' is not allowed; allowed: a finite number > 0"
       ARGS --train-data "0.7 ${WORK_DIR}/data/lic_train_*.bin -1 ${WORK_DIR}/data/lic_val_*.bin" --progress off)
expect(blend-for-val 2 "--val-data '0.5 [^']*' is a blend; allowed: one glob \\(blends are for --train-data\\)"
       ARGS --train-data "${WORK_DIR}/data/lic_train_*.bin" --val-data "0.5 ${WORK_DIR}/data/lic_val_*.bin 0.5 ${WORK_DIR}/data/lic_val_*.bin" --progress off)
expect(blend-for-val-odd 2 "--val-data '0.5 [^']*' is a blend; allowed: one glob \\(blends are for --train-data\\)"
       ARGS --train-data "${WORK_DIR}/data/lic_train_*.bin" --val-data "0.5 ${WORK_DIR}/data/lic_val_*.bin 0.5" --progress off)
# The wall-clock budget: spent at once, the first step saves and the run exits 75.
expect(exit-duration 75 "preempted \\(--exit-duration-mins 1e-06\\): stopped after step 1 with a checkpoint"
       ARGS ${DATA} --global-batch 8 --steps 5 --warmup-steps 1 --exit-duration-mins 0.000001 --save-dir "${WORK_DIR}/ck_time")
expect(exit-duration-no-save-dir 2 "--exit-duration-mins 30 saves and stops the run; it needs --save-dir"
       ARGS ${DATA} --exit-duration-mins 30)
# --eval-only: the val loss of a saved checkpoint is the one its run logged at that step.
expect(eval-train 0 "step +3: val loss [0-9.]+" ARGS ${DATA} --global-batch 8 --steps 3 --warmup-steps 1 --save-dir "${WORK_DIR}/ck_eval")
string(REGEX MATCH "step +3: val loss ([0-9.]+)" logged "${last_output}")
expect(eval-only 0 "eval: step 3, val loss ${CMAKE_MATCH_1}\n"
       ARGS ${DATA} --global-batch 8 --steps 3 --warmup-steps 1 --resume "${WORK_DIR}/ck_eval/step_3" --eval-only)
expect(eval-only-no-val 2 "--eval-only evaluates on the validation data; it needs --val-data"
       ARGS --train-data "${WORK_DIR}/data/lic_train_*.bin" --progress off --eval-only)
# QK-norm trains (Llama; its export is Qwen3's, hf_export); GPT-2 has no Hugging Face names
# for it, said before training.
expect(qk-norm 0 "step +2/2" ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --family llama --qk-norm)
expect(qk-norm-export-hf 2 "the Hugging Face export has no names for GPT-2 with --qk-norm; allowed: gpt2 without it, or llama \\(Qwen3 names\\)"
       ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --qk-norm --export-hf "${WORK_DIR}/qk.safetensors")
# Models no transformers class computes from their exported weights: warned about before
# training, exported all the same (the file serves --init-from; a sliding window on a
# Llama exports as Mistral, Qwen3 or Mixtral, hf_export).
expect(softcap-export-hf 0 "--export-hf: no transformers class computes this model from its weights \\(--attention-softcap=30: no transformers model of GPT-2's or Llama's layout caps attention logits\\); the file will serve --init-from"
       ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --family llama --attention flash --attention-softcap 30
            --export-hf "${WORK_DIR}/softcap.safetensors")
expect(sinks-export-hf 0 "--export-hf: no transformers class computes this model from its weights \\(--softmax-type=learnable: no transformers model of GPT-2's or Llama's layout has attention sinks"
       ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --family llama --attention flash --softmax-type learnable
            --export-hf "${WORK_DIR}/sinks.safetensors")
expect(window-gpt2-export-hf 0 "export: no transformers class computes this model from its weights \\(--attention-window=8 with --family gpt2: GPT-2 has no sliding window\\)"
       ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --attention-window 8 --export-hf "${WORK_DIR}/window.safetensors")
expect(moe-top1-export-hf 0 "--moe-topk=1: Mixtral weighs a single chosen expert by 1, dtrain by its probability"
       ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --family llama --moe-experts 4 --moe-topk 1
            --export-hf "${WORK_DIR}/top1.safetensors")
expect(moe-every-export-hf 0 "--moe-every=2: Mixtral's every block has experts"
       ARGS ${DATA} --global-batch 8 --steps 2 --warmup-steps 1 --family llama --moe-experts 4 --moe-every 2
            --export-hf "${WORK_DIR}/every.safetensors")
expect(lr-decay-unknown 2 "--lr-decay 'wsd' is not known; allowed: cosine, linear, sqrt, constant" ARGS ${DATA} --global-batch 8 --lr-decay wsd)
# Warmup-stable-decay as a cooldown branched off a stable run: 3 steps at a constant lr,
# then a resume that decays linearly to 0 over the last 2 of 5 steps (step 4 at the peak,
# step 5 halfway).
set(WSD ${DATA} --global-batch 8 --warmup-steps 1 --log-every 1 --lr 3e-4 --save-dir "${WORK_DIR}/ck_wsd")
expect(wsd-stable 0 "step +3/3 [^\n]*lr 3.000e-04" ARGS ${WSD} --steps 3 --lr-decay constant)
expect(wsd-cooldown 0 "resumed from [^\n]*step_3.*step +4/5 [^\n]*lr 3.000e-04.*step +5/5 [^\n]*lr 1.500e-04"
       ARGS ${WSD} --steps 5 --lr-decay linear --lr-decay-steps 2 --min-lr 0 --resume auto)
expect(resume-other-model 2 "is from a different model: n_layer is 2 there, 3 here"
       ARGS ${DATA} --global-batch 8 --steps 6 --warmup-steps 1 --n-layer 3 --resume "${WORK_DIR}/ck/step_5")

if(failures GREATER 0)
  message(FATAL_ERROR "${failures} pretrain_gpt CLI check(s) failed")
endif()
