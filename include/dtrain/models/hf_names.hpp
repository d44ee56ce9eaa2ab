// The Hugging Face names and layouts of a Gpt's single-process parameters, for the full
// export and for initialising a run from a released model: GPT-2 as transformers'
// GPT2Model ("h.0.attn.c_attn.weight", Conv1D weights stored [in, out]), Llama as
// LlamaForCausalLM ("model.layers.0.self_attn.q_proj.weight", q/k/v split; MoE blocks as
// Mixtral's "block_sparse_moe.gate" and "experts.<e>.w1/w2/w3", the form of its released
// checkpoints, which transformers' from_pretrained converts; QK-norm as Qwen3's
// "self_attn.q_norm.weight" and "k_norm.weight"; a dense model's sliding window as
// Mistral, whose names are Llama's).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/models/gpt.hpp"

namespace dtrain::models {

// The transformers class that computes config's model from its exported weights
// (GPT2LMHeadModel; LlamaForCausalLM, or with a sliding window MistralForCausalLM;
// Qwen3ForCausalLM with QK-norm, MixtralForCausalLM with experts, either with a window
// too). Empty where none does, with the option that stops it in *why: logit soft-capping,
// a window on GPT-2, or experts Mixtral would route otherwise (MoE blocks not every
// block, sigmoid scores, top-1, the aux-loss-free selection bias); such an export still
// serves --init-from. InvalidArgument when config has no Hugging Face names at all (GPT-2
// with experts or QK-norm, QK-norm with experts): what to_hf would raise, before any
// training.
std::string hf_class(const GptConfig& config, std::string* why = nullptr);

// config's single-process parameters (all of parameter_shapes(), by name) as Hugging Face
// tensors in their layout; InvalidArgument for a configuration without such names (GPT-2
// with experts) or a missing parameter.
std::vector<std::pair<std::string, at::Tensor>> to_hf(const GptConfig& config, const NamedParameters& full);

// The inverse: every parameter of config (parameter_shapes() order) from the Hugging Face
// tensors `get` returns (undefined when absent). InvalidArgument naming the Hugging Face
// tensor that is missing or has the wrong shape. Tensors are float32.
NamedParameters from_hf(const GptConfig& config, const std::function<at::Tensor(const std::string&)>& get);

}  // namespace dtrain::models
