"""Loads a dtrain --export-hf file into Hugging Face transformers (GPT2LMHeadModel,
LlamaForCausalLM, Qwen3ForCausalLM for FAMILY qwen3: Llama with QK-norm,
MistralForCausalLM for FAMILY mistral: Llama with a sliding window, or MixtralForCausalLM
for FAMILY mixtral: Llama with experts, by from_pretrained, which converts the released
checkpoints' per-expert names that the export writes; the class, the window and the
experts per token come from the file's metadata) and prints the mean loss over the first BATCHES val batches the way
dtrain's evaluation forms them (non-shuffled samples of SEQ+1 tokens, GLOBAL per batch);
with EXPECT (dtrain's own val loss, printed to 5 decimals), exits 1 unless the two agree
within 5e-5 (the same float32 means over the same tokens agree within about 5e-6, the
printing's rounding; a wrong name or layout moves the loss by far more, and QK-norm after
the rotary embedding instead of before it by 2e-4).
Exit 77 (skipped) when transformers is not installed.

  python3 hf_export_check.py FILE FAMILY VAL_SHARD SEQ GLOBAL BATCHES D_MODEL N_LAYER N_HEAD N_KV CONTEXT [EXPECT]
"""
import json
import os
import sys
import tempfile

try:
    import numpy as np
    import torch
    import transformers as tf
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as e:  # transformers is not a dependency of the project
    print("skipped:", e)
    sys.exit(77)

path, family, shard = sys.argv[1:4]
seq, batch, batches, d, layers, heads, kv, context = map(int, sys.argv[4:12])
tokens = np.fromfile(shard, dtype=np.uint16, offset=256 * 4).astype(np.int64)
state = load_file(path)
with safe_open(path, "pt") as f:
    meta = json.loads(f.metadata()["dtrain_model"])
want_class = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
if meta.get("hf_class") != want_class:
    print("the file names %s; expected %s" % (meta.get("hf_class"), want_class))
    sys.exit(1)
vocab = state["wte.weight" if family == "gpt2" else "model.embed_tokens.weight"].shape[0]
if family == "gpt2":
    cfg = tf.GPT2Config(vocab_size=vocab, n_positions=context, n_embd=d, n_layer=layers, n_head=heads,
                        activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    model = tf.GPT2LMHeadModel(cfg)
    missing, unexpected = model.transformer.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("attn.bias") and not k.endswith("masked_bias")]
    model.tie_weights()
else:  # the Llama layout: Llama, Qwen3 (QK-norm), Mistral (a sliding window), Mixtral (experts)
    window = meta["attention_window"] or None
    up = "model.layers.0.mlp.up_proj.weight"
    inter = (state[up] if up in state else state["model.layers.0.block_sparse_moe.experts.0.w3.weight"]).shape[0]
    common = dict(vocab_size=vocab, hidden_size=d, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=context, rms_norm_eps=1e-5,
                  tie_word_embeddings="lm_head.weight" not in state, bos_token_id=None, eos_token_id=None)
    if family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=d // heads, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             attention_bias=False, use_sliding_window=window is not None, sliding_window=window,
                             max_window_layers=0)
        model = tf.Qwen3ForCausalLM(cfg)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, head_dim=d // heads, rope_theta=10000.0, sliding_window=window)
        model = tf.MistralForCausalLM(cfg)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**common, head_dim=d // heads, rope_theta=10000.0, sliding_window=window,
                               num_local_experts=meta["moe_experts"], num_experts_per_tok=meta["moe_topk"],
                               router_jitter_noise=0.0)
        model = None
    else:
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0, attention_bias=False, mlp_bias=False)
        model = tf.LlamaForCausalLM(cfg)
    if model is None:  # from_pretrained, with the config beside the file
        with tempfile.TemporaryDirectory() as tmp:
            cfg.save_pretrained(tmp)
            os.symlink(os.path.abspath(path), os.path.join(tmp, "model.safetensors"))
            model, info = tf.MixtralForCausalLM.from_pretrained(tmp, output_loading_info=True)
        missing, unexpected = list(info["missing_keys"]) + list(info["mismatched_keys"]), list(info["unexpected_keys"])
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
        if cfg.tie_word_embeddings:
            missing = [k for k in missing if k != "lm_head.weight"]
            model.tie_weights()
if missing or unexpected:
    print("names differ: missing", missing, "unexpected", unexpected)
    sys.exit(1)
model.eval()
losses = []
with torch.no_grad():
    for b in range(batches):
        rows = torch.tensor(np.stack([tokens[s * seq: s * seq + seq + 1] for s in range(b * batch, (b + 1) * batch)]))
        logits = model(rows[:, :seq]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), rows[:, 1:].reshape(-1)).item())
loss = sum(losses) / len(losses)
print("hf val loss %.6f" % loss)
if len(sys.argv) > 12:
    expect = float(sys.argv[12])
    if not abs(loss - expect) <= 5e-5:
        print("mismatch: dtrain's val loss is %.6f, transformers' %.6f" % (expect, loss))
        sys.exit(1)
