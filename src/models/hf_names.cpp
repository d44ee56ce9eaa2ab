// Hugging Face names and layouts of GPT-2 and Llama parameters, both ways.
#include "dtrain/models/hf_names.hpp"

#include <torch/torch.h>

#include <map>
#include <sstream>

#include "dtrain/core/error.hpp"

namespace dtrain::models {

namespace {

// One of our tensors and the Hugging Face tensors it is made of: `split` rows of ours
// (along dim 0) per Hugging Face tensor, each transposed when `transpose` (Conv1D).
struct Mapping {
  Mapping(std::string o, std::vector<std::string> h, std::vector<std::int64_t> s = {}, bool t = false,
          std::int64_t e = -1)
      : ours(std::move(o)), hf(std::move(h)), split(std::move(s)), transpose(t), expert(e) {}
  std::string ours;
  std::vector<std::string> hf;
  std::vector<std::int64_t> split;  // rows of ours per hf tensor (empty: one tensor)
  bool transpose;
  std::int64_t expert;              // >= 0: row `expert` of our stacked expert tensor
};

std::vector<Mapping> mappings(const GptConfig& c) {
  std::vector<Mapping> m;
  const bool gpt2 = c.family == "gpt2";
  DTRAIN_CHECK_ARG(!(gpt2 && c.moe.enabled()), "the Hugging Face export has no names for GPT-2 with experts; ",
                   "allowed: gpt2 without --moe-experts, or llama (Mixtral names)");
  DTRAIN_CHECK_ARG(!(gpt2 && c.qk_norm), "the Hugging Face export has no names for GPT-2 with --qk-norm; ",
                   "allowed: gpt2 without it, or llama (Qwen3 names)");
  DTRAIN_CHECK_ARG(!(c.qk_norm && c.moe.enabled()), "the Hugging Face export has no names for --qk-norm with ",
                   "experts; allowed: one of them (Qwen3 or Mixtral names)");
  if (gpt2) {
    m.push_back({"tok_emb.weight", {"wte.weight"}});
    m.push_back({"pos_emb.weight", {"wpe.weight"}});
    m.push_back({"ln_f_weight", {"ln_f.weight"}});
    m.push_back({"ln_f_bias", {"ln_f.bias"}});
  } else {
    m.push_back({"tok_emb.weight", {"model.embed_tokens.weight"}});
    m.push_back({"ln_f_weight", {"model.norm.weight"}});
  }
  const std::int64_t hd = c.head_dim(), q = c.n_head * hd, kv = c.n_kv_head * hd;
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    if (gpt2) {
      const std::string p = "h." + std::to_string(i) + ".";
      m.push_back({h + "ln1_weight", {p + "ln_1.weight"}});
      m.push_back({h + "ln1_bias", {p + "ln_1.bias"}});
      m.push_back({h + "ln2_weight", {p + "ln_2.weight"}});
      m.push_back({h + "ln2_bias", {p + "ln_2.bias"}});
      m.push_back({h + "attn_qkv.weight", {p + "attn.c_attn.weight"}, {}, true});
      m.push_back({h + "attn_qkv.bias", {p + "attn.c_attn.bias"}});
      m.push_back({h + "attn_proj.weight", {p + "attn.c_proj.weight"}, {}, true});
      m.push_back({h + "attn_proj.bias", {p + "attn.c_proj.bias"}});
      m.push_back({h + "mlp_fc.weight", {p + "mlp.c_fc.weight"}, {}, true});
      m.push_back({h + "mlp_fc.bias", {p + "mlp.c_fc.bias"}});
      m.push_back({h + "mlp_proj.weight", {p + "mlp.c_proj.weight"}, {}, true});
      m.push_back({h + "mlp_proj.bias", {p + "mlp.c_proj.bias"}});
      if (c.learned_sinks()) m.push_back({h + "attn_sinks", {p + "attn.sinks"}});  // no HF model's
      continue;
    }
    const std::string p = "model.layers." + std::to_string(i) + ".";
    m.push_back({h + "ln1_weight", {p + "input_layernorm.weight"}});
    m.push_back({h + "ln2_weight", {p + "post_attention_layernorm.weight"}});
    m.push_back({h + "attn_qkv.weight",
                 {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"},
                 {q, kv, kv}});
    m.push_back({h + "attn_proj.weight", {p + "self_attn.o_proj.weight"}});
    if (c.qk_norm) {  // Qwen3's names (Qwen3ForCausalLM: Llama's and these two)
      m.push_back({h + "q_norm_weight", {p + "self_attn.q_norm.weight"}});
      m.push_back({h + "k_norm_weight", {p + "self_attn.k_norm.weight"}});
    }
    if (c.learned_sinks()) m.push_back({h + "attn_sinks", {p + "self_attn.sinks"}});  // gpt-oss's name
    if (c.moe.is_moe_block(i)) {
      m.push_back({h + "moe.router.weight", {p + "block_sparse_moe.gate.weight"}});
      for (std::int64_t e = 0; e < c.moe.experts; ++e) {
        const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
        m.push_back({h + "moe.gate.weight", {x + "w1.weight"}, {}, false, e});
        m.push_back({h + "moe.proj.weight", {x + "w2.weight"}, {}, false, e});
        m.push_back({h + "moe.fc.weight", {x + "w3.weight"}, {}, false, e});
      }
      continue;
    }
    m.push_back({h + "mlp_gate.weight", {p + "mlp.gate_proj.weight"}});
    m.push_back({h + "mlp_fc.weight", {p + "mlp.up_proj.weight"}});
    m.push_back({h + "mlp_proj.weight", {p + "mlp.down_proj.weight"}});
  }
  if (!c.tie_embeddings) m.push_back({"lm_head.weight", {"lm_head.weight"}});
  return m;
}

}  // namespace

std::string hf_class(const GptConfig& c, std::string* why) {
  mappings(c);  // the names' own refusals first
  const bool gpt2 = c.family == "gpt2", window = c.attention_window > 0;
  std::ostringstream none;  // why no class computes the model, if none does
  if (c.attention_softcap != 0) {
    none << "--attention-softcap=" << c.attention_softcap << ": no transformers model of GPT-2's or Llama's layout "
         << "caps attention logits";
  } else if (c.attention_sinks()) {
    none << "--softmax-type=" << c.softmax_type << ": no transformers model of GPT-2's or Llama's layout has "
         << "attention sinks (gpt-oss's has, in a layout of its own)";
  } else if (c.window_skip_every > 0) {
    none << "--window-attn-skip-freq=" << c.window_skip_every << ": the exported layouts' classes (Mistral's, "
         << "Qwen3's, Mixtral's) give every layer the one sliding window";
  } else if (window && gpt2) {
    none << "--attention-window=" << c.attention_window << " with --family gpt2: GPT-2 has no sliding window";
  } else if (c.moe.enabled() && c.moe.every != 1) {  // Mixtral: every block's experts, softmax over the top k
    none << "--moe-every=" << c.moe.every << ": Mixtral's every block has experts";
  } else if (c.moe.enabled() && c.moe.score != "softmax") {
    none << "--moe-score=" << c.moe.score << ": Mixtral's router takes a softmax";
  } else if (c.moe.enabled() && c.moe.topk == 1) {
    none << "--moe-topk=1: Mixtral weighs a single chosen expert by 1, dtrain by its probability";
  } else if (c.moe.enabled() && c.moe.bias_update_rate != 0) {
    none << "--moe-bias-rate=" << c.moe.bias_update_rate << ": the selection bias dtrain learns is not a "
         << "parameter, and Mixtral's router has none";
  }
  if (why != nullptr) *why = none.str();
  if (!none.str().empty()) return "";
  if (gpt2) return "GPT2LMHeadModel";
  if (c.qk_norm) return "Qwen3ForCausalLM";
  if (c.moe.enabled()) return "MixtralForCausalLM";
  return window ? "MistralForCausalLM" : "LlamaForCausalLM";
}

std::vector<std::pair<std::string, at::Tensor>> to_hf(const GptConfig& config, const NamedParameters& full) {
  std::map<std::string, at::Tensor> ours(full.begin(), full.end());
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& m : mappings(config)) {
    const auto it = ours.find(m.ours);
    DTRAIN_CHECK_ARG(it != ours.end(), "to_hf: parameter '", m.ours, "' is missing");
    auto t = it->second.detach();
    if (m.expert >= 0) t = t[m.expert];
    if (m.split.empty()) {
      out.emplace_back(m.hf.front(), (m.transpose ? t.t() : t).contiguous());
      continue;
    }
    std::int64_t row = 0;
    for (std::size_t k = 0; k < m.hf.size(); ++k) {
      out.emplace_back(m.hf[k], t.narrow(0, row, m.split[k]).contiguous());
      row += m.split[k];
    }
  }
  return out;
}

NamedParameters from_hf(const GptConfig& config, const std::function<at::Tensor(const std::string&)>& get) {
  std::map<std::string, std::vector<std::int64_t>> shapes;
  for (const auto& [name, shape] : config.parameter_shapes()) shapes[name] = shape;
  std::map<std::string, at::Tensor> ours;
  for (const auto& m : mappings(config)) {
    const auto& shape = shapes.at(m.ours);
    auto& dest = ours[m.ours];
    if (!dest.defined()) dest = torch::empty(shape, torch::kFloat);
    auto target = m.expert >= 0 ? dest[m.expert] : dest;
    std::int64_t row = 0;
    for (std::size_t k = 0; k < m.hf.size(); ++k) {
      auto part = m.split.empty() ? target : target.narrow(0, row, m.split[k]);
      row += m.split.empty() ? 0 : m.split[k];
      auto t = get(m.hf[k]);
      DTRAIN_CHECK_ARG(t.defined(), "Hugging Face tensor '", m.hf[k], "' is missing (needed for ", m.ours, ")");
      if (m.transpose) t = t.t();
      DTRAIN_CHECK_ARG(t.sizes() == part.sizes(), "Hugging Face tensor '", m.hf[k], "' is ",
                       (m.transpose ? t.t().sizes() : t.sizes()), "; this model needs ",
                       (m.transpose ? part.t().sizes() : part.sizes()));
      part.copy_(t);
    }
  }
  NamedParameters out;
  for (const auto& [name, shape] : config.parameter_shapes()) out.emplace_back(name, ours.at(name));
  return out;
}

}  // namespace dtrain::models
