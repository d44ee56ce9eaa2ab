// The model options the Trainer-driven benchmarks share (--preset, --n-layer, --family,
// --n-kv-head): their CLI declarations, and the GptConfig they give, checked for what
// the benchmarks' synthetic uint16 token shards can hold.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "dtrain/core/error.hpp"
#include "dtrain/models/gpt.hpp"

namespace dtrain::bench {

struct ModelOptions {
  std::string preset = "tiny", family;
  std::int64_t n_layer = 0, n_kv_head = 0;

  void add_to(CLI::App& app) {
    app.add_option("--preset", preset, "model preset (vocabulary <= 65536)");
    app.add_option("--n-layer", n_layer, "override the preset's block count (0: keep)")->check(CLI::NonNegativeNumber);
    app.add_option("--family", family, "override the preset's family: gpt2 or llama (SwiGLU, RMSNorm, RoPE)");
    app.add_option("--n-kv-head", n_kv_head, "llama: key/value heads (0: keep)")->check(CLI::NonNegativeNumber);
  }
  // The preset with the overrides (validate() is the caller's, after its own changes).
  models::GptConfig config() const {
    auto cfg = models::GptConfig::preset(preset);
    if (n_layer > 0) cfg.n_layer = n_layer;
    if (!family.empty()) cfg.family = family;
    if (n_kv_head > 0) cfg.n_kv_head = n_kv_head;
    DTRAIN_CHECK_ARG(cfg.vocab_size <= 65536, "--preset ", preset, " has vocabulary ", cfg.vocab_size,
                     "; token shards hold uint16 ids: allowed presets have vocabularies <= 65536");
    return cfg;
  }
};

}  // namespace dtrain::bench
