// The GPT model: presets and parameter counts, validation, seeded initialisation, loss at
// initialisation, causality, sliding-window attention's reach (and local and global blocks), packed documents (isolated, and
// with reset positions each computed as if alone), activation checkpointing leaves gradients unchanged, a tiny
// model learns a repeating sequence, and pipeline stages chained equal the whole model.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "common/errors.hpp"
#include "dtrain/core/error.hpp"
#include "dtrain/models/gpt.hpp"
#include "dtrain/train/device_stats.hpp"
#include "dtrain/optim/optim.hpp"

namespace dtrain::models {
namespace {

ContextPtr single() { return ParallelContext::single_process(); }

GptConfig tiny_llama() {
  GptConfig c = GptConfig::preset("tiny");
  c.family = "llama";
  c.n_kv_head = 2;  // grouped-query attention
  c.tie_embeddings = false;
  return c;
}

GptConfig with_qk_norm(GptConfig c) {
  c.qk_norm = true;
  return c;
}

std::int64_t count(Gpt& m) {
  std::int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}

TEST(GptConfig, PresetsHaveTheKnownParameterCounts) {
  EXPECT_EQ(GptConfig::preset("gpt2-124m").num_parameters(), 124475904);  // llm.c's figure
  EXPECT_EQ(GptConfig::preset("llama-1b").num_parameters(), 1235814400);  // Llama 3.2 1B
  EXPECT_GT(GptConfig::preset("gpt2-350m").num_parameters(), 350'000'000);
  for (const auto& c : {GptConfig::preset("tiny"), tiny_llama(), with_qk_norm(GptConfig::preset("tiny")),
                        with_qk_norm(tiny_llama())}) {
    Gpt m(single(), c, 1);
    EXPECT_EQ(count(m), c.num_parameters()) << c.family << (c.qk_norm ? " qk-norm" : "");
  }
  try {
    GptConfig::preset("gpt5");
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("allowed: tiny, gpt2-124m, gpt2-350m, llama-1b"), std::string::npos);
  }
  GptConfig bad = GptConfig::preset("tiny");
  bad.n_kv_head = 2;
  EXPECT_THROW(bad.validate(), InvalidArgument);  // GQA needs llama
  bad = GptConfig::preset("tiny");
  bad.d_model = 66;
  EXPECT_THROW(Gpt(single(), bad, 1), InvalidArgument);
}

TEST(Gpt, InitialisationIsAPureFunctionOfTheSeed) {
  Gpt a(single(), GptConfig::preset("tiny"), 7), b(single(), GptConfig::preset("tiny"), 7), c(single(), GptConfig::preset("tiny"), 8);
  auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  bool any_diff = false;
  for (const auto& item : pa) {
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
    any_diff = any_diff || !torch::equal(item.value(), pc[item.key()]);
  }
  EXPECT_TRUE(any_diff);
  // Residual projections are scaled by 1/sqrt(2 n_layer).
  const double s_fc = pa["h.0.mlp_fc.weight"].std().item<double>();
  const double s_proj = pa["h.0.mlp_proj.weight"].std().item<double>();
  EXPECT_NEAR(s_proj / s_fc, 1.0 / std::sqrt(4.0), 0.05);
}

TEST(Gpt, LossAtInitIsNearUniformAndModelIsCausal) {
  for (const auto& cfg : {GptConfig::preset("tiny"), tiny_llama()}) {
    Gpt m(single(), cfg, 3);
    auto idx = torch::randint(0, 256, {4, 32}, torch::kLong);
    const double loss = m->loss(idx, torch::roll(idx, -1, 1)).item<double>();
    EXPECT_NEAR(loss, std::log(256.0), 0.3) << cfg.family;
    // Changing the last token never changes earlier logits.
    auto idx2 = idx.clone();
    idx2.index_put_({torch::indexing::Slice(), -1}, (idx.select(1, 31) + 1) % 256);
    torch::NoGradGuard no_grad;
    auto l1 = m->forward(idx), l2 = m->forward(idx2);
    EXPECT_TRUE(torch::allclose(l1.slice(1, 0, 31), l2.slice(1, 0, 31), 1e-5, 1e-6)) << cfg.family;
    EXPECT_FALSE(torch::allclose(l1.slice(1, 31), l2.slice(1, 31))) << cfg.family;
  }
}

// A sliding window of W tokens per layer: through n_layer layers token t sees tokens from
// t - n_layer (W - 1) on, and no earlier one; a window as long as the context is no window.
TEST(Gpt, AttentionWindowBoundsWhatEachTokenSees) {
  for (auto cfg : {GptConfig::preset("tiny"), tiny_llama()}) {
    SCOPED_TRACE(cfg.family);
    Gpt full(single(), cfg, 3);
    cfg.attention_window = 5;
    Gpt windowed(single(), cfg, 3);  // the same parameters
    auto idx = torch::randint(0, 256, {2, 32}, torch::kLong);
    const std::int64_t reach = cfg.n_layer * (cfg.attention_window - 1), t = 31;
    torch::NoGradGuard no_grad;
    auto changed = [&](Gpt& m, std::int64_t pos) {
      auto idx2 = idx.clone();
      idx2.index_put_({torch::indexing::Slice(), pos}, (idx.select(1, pos) + 1) % 256);
      return !torch::allclose(m->forward(idx).select(1, t), m->forward(idx2).select(1, t), 1e-5, 1e-6);
    };
    EXPECT_FALSE(changed(windowed, t - reach - 1)) << "a token outside the window reached the last logits";
    EXPECT_TRUE(changed(windowed, t - reach)) << "the window's farthest token did not";
    EXPECT_TRUE(changed(full, t - reach - 1));
    auto l0 = full->forward(idx), l1 = windowed->forward(idx);
    EXPECT_TRUE(torch::allclose(l0.slice(1, 0, 5), l1.slice(1, 0, 5), 1e-5, 1e-6)) << "inside one window";
    EXPECT_FALSE(torch::allclose(l0, l1));
    cfg.attention_window = cfg.context;
    Gpt whole(single(), cfg, 3);
    EXPECT_TRUE(torch::allclose(l0, whole->forward(idx), 1e-5, 1e-6));
  }
  auto c = GptConfig::preset("tiny");
  c.attention_window = -2;
  EXPECT_THROW(c.validate(), InvalidArgument);
  // Attention FLOPs count the window's keys, not the sequence's.
  c.attention_window = 256;
  auto none = GptConfig::preset("tiny");
  EXPECT_DOUBLE_EQ(none.flops_per_token(1024) - c.flops_per_token(1024),
                   12.0 * c.n_layer * c.n_head * c.head_dim() * (1024 - 256));
  EXPECT_DOUBLE_EQ(none.flops_per_token(200), c.flops_per_token(200));
}

// Local and global blocks (--window-attn-skip-freq N, Megatron's): every N-th block (1
// of tiny's 2 at N 2: block 1) attends to every earlier token, the others keep the window:
// a token past every window's reach still reaches the last logits through the global
// block; N 1 makes every block global (the model without a window), and N 2 differs from
// both; the FLOPs count each block's own keys; N without a window, or negative, is refused
// naming the option.
TEST(Gpt, WindowSkipMakesEveryNthBlockGlobal) {
  for (auto cfg : {GptConfig::preset("tiny"), tiny_llama()}) {
    SCOPED_TRACE(cfg.family);
    Gpt full(single(), cfg, 3);
    cfg.attention_window = 5;
    Gpt windowed(single(), cfg, 3);
    cfg.window_skip_every = 2;
    EXPECT_EQ(cfg.window_of(0), 5);
    EXPECT_EQ(cfg.window_of(1), 0);
    Gpt mixed(single(), cfg, 3);
    cfg.window_skip_every = 1;
    Gpt global(single(), cfg, 3);
    auto idx = torch::randint(0, 256, {2, 32}, torch::kLong);
    const std::int64_t t = 31, far = t - cfg.n_layer * (cfg.attention_window - 1) - 1;
    torch::NoGradGuard no_grad;
    auto changed = [&](Gpt& m, std::int64_t pos) {
      auto idx2 = idx.clone();
      idx2.index_put_({torch::indexing::Slice(), pos}, (idx.select(1, pos) + 1) % 256);
      return !torch::allclose(m->forward(idx).select(1, t), m->forward(idx2).select(1, t), 1e-5, 1e-6);
    };
    EXPECT_FALSE(changed(windowed, far));
    EXPECT_TRUE(changed(mixed, far)) << "the global block did not reach past the windows";
    const auto l_full = full->forward(idx), l_win = windowed->forward(idx), l_mixed = mixed->forward(idx);
    EXPECT_TRUE(torch::allclose(global->forward(idx), l_full, 1e-5, 1e-6)) << "N 1: every block global";
    EXPECT_FALSE(torch::allclose(l_mixed, l_full));
    EXPECT_FALSE(torch::allclose(l_mixed, l_win));
  }
  auto c = GptConfig::preset("tiny");
  c.window_skip_every = 2;
  testing::expect_has(testing::error_message([&] { c.validate(); }),
                      {"window_skip_every=2 (--window-attn-skip-freq) is not allowed without --attention-window"});
  c.attention_window = 256, c.window_skip_every = -1;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.window_skip_every = 2;  // block 1 of 2 global: half the windowed blocks' saving
  auto windowed = c;
  windowed.window_skip_every = 0;
  EXPECT_DOUBLE_EQ(c.flops_per_token(1024) - windowed.flops_per_token(1024),
                   12.0 * c.n_head * c.head_dim() * (1024 - 256));
}

// Packed documents (--document-separator): a token's logits depend on no token before the
// separator that ends the previous document, through every layer, on both attention
// backends (sdpa takes the mask, flash its reference path here) and under activation
// checkpointing (whose recomputation gives the plain run's gradients); the separator
// itself still sees its own document.
TEST(Gpt, DocumentSeparatorIsolatesDocuments) {
  constexpr std::int64_t kSep = 7;
  auto idx = torch::randint(8, 256, {2, 32}, torch::kLong);  // no separator yet
  idx.index_put_({0, 10}, kSep), idx.index_put_({0, 20}, kSep), idx.index_put_({1, 5}, kSep);
  auto perturbed = [&](std::int64_t b, std::int64_t from, std::int64_t to) {
    auto idx2 = idx.clone();
    for (std::int64_t t = from; t < to; ++t) idx2.index_put_({b, t}, 8 + (idx[b][t].item<std::int64_t>() - 7) % 248);
    return idx2;
  };
  for (const auto& base : {GptConfig::preset("tiny"), tiny_llama()}) {
    for (auto backend : {ops::AttentionBackend::kSdpa, ops::AttentionBackend::kFlash}) {
      auto cfg = base;
      SCOPED_TRACE(cfg.family + " " + ops::to_string(backend));
      cfg.attention = backend;
      Gpt plain(single(), cfg, 3);
      cfg.document_separator = kSep;
      Gpt packed(single(), cfg, 3);  // the same parameters
      cfg.recompute_blocks = -1;
      Gpt recomputed(single(), cfg, 3);
      const auto l = packed->forward(idx).detach();
      // Batch 0: documents [0, 10], [11, 20], [21, 31]; the middle one's tokens change.
      const auto l2 = packed->forward(perturbed(0, 11, 20)).detach();
      EXPECT_TRUE(torch::allclose(l.select(0, 0).slice(0, 21), l2.select(0, 0).slice(0, 21), 1e-5, 1e-6))
          << "the last document saw the one before it";
      EXPECT_FALSE(torch::allclose(l.select(0, 0).slice(0, 11, 21), l2.select(0, 0).slice(0, 11, 21)));
      EXPECT_TRUE(torch::allclose(l.select(0, 1), l2.select(0, 1), 1e-5, 1e-6)) << "the other row";
      // Batch 1: documents [0, 5], [6, 31]; the separator sees its own document.
      const auto l3 = packed->forward(perturbed(1, 0, 5)).detach();
      EXPECT_TRUE(torch::allclose(l.select(0, 1).slice(0, 6), l3.select(0, 1).slice(0, 6), 1e-5, 1e-6));
      EXPECT_FALSE(torch::allclose(l.select(0, 1)[5], l3.select(0, 1)[5]));
      // Without the option the same change reaches every later token; before the first
      // separator the two models agree.
      const auto p = plain->forward(idx).detach();
      EXPECT_FALSE(torch::allclose(p.select(0, 1).slice(0, 6),
                                   plain->forward(perturbed(1, 0, 5)).detach().select(0, 1).slice(0, 6), 1e-5, 1e-6));
      EXPECT_TRUE(torch::allclose(p.slice(1, 0, 6), l.slice(1, 0, 6), 1e-5, 1e-6));
      // Activation checkpointing: the same logits and gradients.
      auto targets = torch::randint(0, 256, {2, 32}, torch::kLong);
      packed->zero_grad(), recomputed->zero_grad();
      packed->loss(idx, targets).backward();
      const auto lr = recomputed->forward(idx);
      EXPECT_TRUE(torch::allclose(lr.detach(), l, 1e-5, 1e-6));
      recomputed->loss(idx, targets).backward();
      auto want = packed->named_parameters();
      for (const auto& item : recomputed->named_parameters()) {
        EXPECT_TRUE(torch::allclose(item.value().grad(), want[item.key()].grad(), 1e-5, 1e-6)) << item.key();
      }
    }
  }
  auto c = GptConfig::preset("tiny");
  c.document_separator = c.vocab_size;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.document_separator = -2;
  EXPECT_THROW(c.validate(), InvalidArgument);
}

// --reset-position-ids with packed documents: each document of a packed row gets the
// logits, and summed over its tokens the loss gradients, that it gets alone at the start of
// a row (llm.c's and FlashAttention varlen's meaning of packing), for both families and
// backends, with and without activation checkpointing. Without the option GPT-2's learned
// positions see where a document starts.
TEST(Gpt, ResetPositionIdsComputesEachDocumentAlone) {
  constexpr std::int64_t kSep = 7, kT = 32;
  // Row 0: documents of 10, 9 and 13 tokens; row 1: 6 and 26 (all but the last end with
  // the separator).
  const std::vector<std::vector<std::int64_t>> lengths = {{10, 9, 13}, {6, 26}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto idx = torch::randint(8, 256, {2, kT}, gen);
  const auto targets = torch::randint(0, 256, {2, kT}, gen);
  for (std::int64_t b = 0; b < 2; ++b) {
    std::int64_t end = 0;
    for (std::size_t d = 0; d + 1 < lengths[b].size(); ++d) idx.index_put_({b, (end += lengths[b][d]) - 1}, kSep);
  }
  for (const auto& base : {GptConfig::preset("tiny"), tiny_llama()}) {
    for (auto backend : {ops::AttentionBackend::kSdpa, ops::AttentionBackend::kFlash}) {
      for (bool checkpointing : {false, true}) {
        auto cfg = base;
        cfg.attention = backend, cfg.recompute_blocks = checkpointing ? -1 : 0;
        cfg.document_separator = kSep, cfg.reset_position_ids = true;
        SCOPED_TRACE(cfg.family + " " + ops::to_string(backend) + (checkpointing ? " checkpointing" : ""));
        Gpt packed(single(), cfg, 3), alone(single(), cfg, 3);
        const auto logits = packed->forward(idx).detach();
        (packed->loss(idx, targets) * static_cast<double>(2 * kT)).backward();  // summed over tokens
        for (std::int64_t b = 0; b < 2; ++b) {
          std::int64_t start = 0;
          for (const auto len : lengths[b]) {
            const auto doc = idx.slice(1, start, start + len).narrow(0, b, 1);
            EXPECT_TRUE(torch::allclose(alone->forward(doc).detach()[0], logits[b].slice(0, start, start + len), 1e-5,
                                        1e-5))
                << "row " << b << ", the document at " << start;
            (alone->loss(doc, targets.slice(1, start, start + len).narrow(0, b, 1)) * static_cast<double>(len))
                .backward();
            start += len;
          }
        }
        auto want = alone->named_parameters();
        for (const auto& item : packed->named_parameters()) {
          EXPECT_TRUE(torch::allclose(item.value().grad(), want[item.key()].grad(), 1e-4, 1e-5)) << item.key();
        }
      }
    }
  }
  // Without it, the second document's learned positions start at 10.
  auto cfg = GptConfig::preset("tiny");
  cfg.document_separator = kSep;
  Gpt offset(single(), cfg, 3);
  EXPECT_FALSE(torch::allclose(offset->forward(idx.slice(1, 10, 19).narrow(0, 0, 1)).detach()[0],
                               offset->forward(idx).detach()[0].slice(0, 10, 19), 1e-3, 1e-3));
  cfg.document_separator = -1, cfg.reset_position_ids = true;
  EXPECT_THROW(cfg.validate(), InvalidArgument);
}

// Recomputing the first N blocks (N = 1, 2, all) changes no gradient, and the peak of
// live CPU tensors over a forward and backward falls as N grows (each recomputed block
// keeps only its input).
TEST(Gpt, ActivationCheckpointingLeavesGradientsUnchangedAndLowersThePeak) {
  train::enable_cpu_memory_tracking();
  const c10::Device cpu(c10::kCPU);
  for (auto cfg : {GptConfig::preset("tiny"), tiny_llama()}) {
    cfg.n_layer = 4;
    auto idx = torch::randint(0, 256, {8, 64}, torch::kLong);
    auto tgt = torch::randint(0, 256, {8, 64}, torch::kLong);
    std::vector<double> peaks;
    std::vector<torch::Tensor> reference;
    for (std::int64_t n : {0, 1, 2, -1}) {
      cfg.recompute_blocks = n;
      Gpt model(single(), cfg, 5);
      ASSERT_TRUE(train::reset_peak_memory(cpu));
      const double before = train::memory_stats(cpu).current_mib;
      model->loss(idx, tgt).backward();
      peaks.push_back(train::memory_stats(cpu).peak_mib - before);
      const auto params = model->parameter_list();
      for (std::size_t i = 0; i < params.size(); ++i) {
        const auto g = params[i].second.grad();
        ASSERT_TRUE(g.defined()) << params[i].first;
        if (n == 0) {
          reference.push_back(g);
        } else {
          EXPECT_TRUE(torch::allclose(g, reference[i], 1e-5, 1e-7)) << cfg.family << " " << n << " " << params[i].first;
        }
      }
    }
    for (std::size_t k = 1; k < peaks.size(); ++k) {
      EXPECT_LT(peaks[k], peaks[k - 1]) << cfg.family << ": peaks " << peaks[0] << ", " << peaks[1] << ", " << peaks[2]
                                        << ", " << peaks[3] << " MiB";
    }
  }
  auto bad = GptConfig::preset("tiny");
  bad.recompute_blocks = -2;
  EXPECT_THROW(bad.validate(), InvalidArgument);
}

// With dropout, the recomputation in backward replays the forward's masks (the RNG
// tracker's states are saved and restored), so checkpointing still changes nothing; the
// masks are a function of the seed and eval() turns dropout off.
TEST(Gpt, DropoutMasksReplayUnderActivationCheckpointing) {
  auto flash = tiny_llama();  // flash attention's dropout: a seed drawn from the same stream
  flash.attention = ops::AttentionBackend::kFlash;
  for (auto cfg : {GptConfig::preset("tiny"), tiny_llama(), flash}) {
    SCOPED_TRACE(ops::to_string(cfg.attention));
    cfg.dropout = 0.2;
    Gpt plain(single(), cfg, 5);
    cfg.recompute_blocks = -1;
    Gpt ckpt(single(), cfg, 5);
    auto idx = torch::randint(0, 256, {2, 16}, torch::kLong);
    auto tgt = torch::randint(0, 256, {2, 16}, torch::kLong);
    auto la = plain->loss(idx, tgt), lb = ckpt->loss(idx, tgt);
    EXPECT_EQ(la.item<float>(), lb.item<float>()) << cfg.family;
    la.backward();
    lb.backward();
    auto a = plain->named_parameters(), b = ckpt->named_parameters();
    for (const auto& item : a) {
      EXPECT_TRUE(torch::allclose(item.value().grad(), b[item.key()].grad(), 1e-5, 1e-7))
          << cfg.family << " " << item.key();
    }
    // The next draw differs (the streams advance); eval() is deterministic and mask-free.
    EXPECT_NE(plain->loss(idx, tgt).item<float>(), la.item<float>());
    plain->eval();
    auto no_dropout = cfg;
    no_dropout.dropout = 0;
    no_dropout.recompute_blocks = 0;
    Gpt reference(single(), no_dropout, 5);
    EXPECT_EQ(plain->loss(idx, tgt).item<float>(), reference->loss(idx, tgt).item<float>());
  }
}

// QK-norm: the attention sees each head's query and key normed, so scaling the query (or
// key) rows of attn_qkv changes nothing with it and everything without it; its weights
// learn (non-zero gradients, and scaling them does change the output); the fused norm's
// reference path agrees with the plain one.
TEST(Gpt, QkNormMakesAttentionBlindToTheScaleOfQueriesAndKeys) {
  torch::manual_seed(3);
  const auto idx = torch::randint(0, 256, {2, 24}, torch::kLong), tgt = torch::randint(0, 256, {2, 24}, torch::kLong);
  for (const auto& base : {GptConfig::preset("tiny"), tiny_llama()}) {
    const auto D = base.head_dim(), H = base.n_head, Hkv = base.n_kv_head;
    for (bool qk : {false, true}) {
      auto cfg = base;
      cfg.qk_norm = qk;
      SCOPED_TRACE(cfg.family + (qk ? " qk-norm" : ""));
      Gpt m(single(), cfg, 4);
      torch::NoGradGuard no_grad;
      const auto before = m->forward(idx);
      auto params = m->named_parameters();
      for (auto [from, rows] : {std::pair{std::int64_t{0}, H * D}, std::pair{H * D, Hkv * D}}) {  // q rows, k rows
        for (const char* name : {"h.0.attn_qkv.weight", "h.1.attn_qkv.weight", "h.0.attn_qkv.bias", "h.1.attn_qkv.bias"}) {
          if (params.contains(name)) params[name].narrow(0, from, rows).mul_(3.0);
        }
      }
      const auto after = m->forward(idx);
      EXPECT_EQ(torch::allclose(before, after, 1e-4, 1e-4), qk);
      if (!qk) continue;
      EXPECT_TRUE(torch::equal(params["h.1.k_norm_weight"], torch::ones({D}))) << "initialised to ones";
      params["h.0.q_norm_weight"].mul_(2.0);
      EXPECT_FALSE(torch::allclose(after, m->forward(idx), 1e-4, 1e-4)) << "the weight is used";
    }
    auto cfg = with_qk_norm(base);
    Gpt plain(single(), cfg, 4);
    cfg.fused_norm = true;
    Gpt fused(single(), cfg, 4);
    const auto lp = plain->loss(idx, tgt), lf = fused->loss(idx, tgt);
    EXPECT_NEAR(lp.item<double>(), lf.item<double>(), 1e-5);
    lp.backward();
    lf.backward();
    auto pp = plain->named_parameters(), pf = fused->named_parameters();
    for (const char* name : {"h.0.q_norm_weight", "h.0.k_norm_weight", "h.1.k_norm_weight"}) {
      EXPECT_GT(pp[name].grad().abs().sum().item<double>(), 0) << name;
      EXPECT_TRUE(torch::allclose(pp[name].grad(), pf[name].grad(), 1e-4, 1e-6)) << name;
    }
  }
}

// PaLM's z-loss (z_loss): in training mode the loss is the cross-entropy plus z times the
// mean over the counted targets of the logits' log-sum-exp squared, and its gradient that
// sum's; every loss form (plain, fused_ce, fused_linear_ce; the CPU's reference paths)
// gives the same loss and head gradient. In eval mode (validation) the cross-entropy
// alone. A negative z is refused, naming --z-loss.
TEST(Gpt, ZLossIsAddedInTrainingInEveryLossForm) {
  torch::manual_seed(5);
  const auto idx = torch::randint(0, 256, {2, 24}, torch::kLong);
  auto tgt = torch::randint(0, 256, {2, 24}, torch::kLong);
  tgt[0][3] = -100;  // not counted
  auto cfg = tiny_llama();
  Gpt plain(single(), cfg, 4);
  const auto logits = plain->forward(idx).reshape({-1, 256}).to(torch::kDouble);
  const auto t = tgt.reshape({-1}), kept = t.ne(-100);
  const double ce = at::cross_entropy_loss(logits, t, {}, at::Reduction::Mean, -100).item<double>();
  const double lse2 = ((logits.logsumexp(1).square() * kept).sum() / kept.sum()).item<double>();
  const double z = 0.01;
  at::Tensor head_grad;
  for (int form = 0; form < 3; ++form) {
    SCOPED_TRACE(form == 0 ? "plain" : form == 1 ? "fused_ce" : "fused_linear_ce");
    auto c = cfg;
    c.z_loss = z;
    c.fused_ce = form == 1;
    c.fused_linear_ce = form == 2;
    Gpt m(single(), c, 4);
    auto loss = m->loss(idx, tgt);
    EXPECT_NEAR(loss.item<double>(), ce + z * lse2, 1e-4);
    loss.backward();
    const auto g = m->named_parameters()["lm_head.weight"].grad();
    if (form == 0) head_grad = g;
    EXPECT_TRUE(torch::allclose(g, head_grad, 1e-4, 1e-6));
    m->eval();
    EXPECT_NEAR(m->loss(idx, tgt).item<double>(), ce, 1e-4) << "validation: the cross-entropy alone";
  }
  auto bad = cfg;
  bad.z_loss = -1;
  try {
    Gpt m(single(), bad, 4);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("z_loss=-1 (--z-loss) is out of range"), std::string::npos) << e.what();
  }
}

TEST(GptConfig, ParameterShapesListTheModelsParametersInOrder) {
  auto tied = tiny_llama();
  tied.tie_embeddings = true;
  for (const auto& cfg : {GptConfig::preset("tiny"), tiny_llama(), tied, with_qk_norm(GptConfig::preset("tiny")),
                          with_qk_norm(tiny_llama())}) {
    Gpt m(single(), cfg, 1);
    const auto params = m->parameter_list();
    const auto shapes = cfg.parameter_shapes();
    ASSERT_EQ(params.size(), shapes.size()) << cfg.family;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(params[i].first, shapes[i].first);
      EXPECT_EQ(params[i].second.sizes().vec(), shapes[i].second) << shapes[i].first;
    }
  }
}

// Three stages of a 5-block model run one after another, each on the previous stage's
// output detached (as a pipeline receives it), with the input gradient passed back:
// the same loss and the same gradients as the whole model; a stage's parameters are the
// whole model's of the same names; with tied embeddings the first and last stages' copies
// of the token embedding together get the whole model's gradient.
TEST(Gpt, PipelineStagesChainedEqualTheWholeModel) {
  auto gpt2 = GptConfig::preset("tiny");
  auto llama = tiny_llama();
  auto documents = llama;  // later stages take the tokens for their document mask
  documents.document_separator = 7;
  for (auto cfg : {gpt2, llama, documents}) {
    cfg.n_layer = 5;
    Gpt whole(single(), cfg, 9);
    std::vector<Gpt> stages;
    stages.emplace_back(single(), cfg, 9, GptStage{0, 2, true, false});
    stages.emplace_back(single(), cfg, 9, GptStage{2, 3, false, false});
    stages.emplace_back(single(), cfg, 9, GptStage{3, 5, false, true});
    const auto reference = whole->named_parameters();
    std::int64_t held = 0;
    for (auto& st : stages) {
      for (const auto& item : st->named_parameters()) {
        EXPECT_TRUE(torch::equal(item.value(), reference[item.key()])) << item.key();
        ++held;
      }
    }
    EXPECT_EQ(held, static_cast<std::int64_t>(reference.size()) + (cfg.tie_embeddings ? 1 : 0));

    auto idx = torch::randint(0, 256, {2, 16}, torch::kLong);
    idx.index_put_({0, 5}, 7), idx.index_put_({1, 9}, 7);
    auto tgt = torch::randint(0, 256, {2, 16}, torch::kLong);
    auto ref_loss = whole->loss(idx, tgt);
    ref_loss.backward();
    // Forward, each stage on a detached copy of the previous output.
    std::vector<torch::Tensor> inputs, outputs;
    torch::Tensor x = idx;
    for (std::size_t s = 0; s < stages.size(); ++s) {
      if (s > 0) x = x.detach().requires_grad_(true);
      inputs.push_back(x);
      outputs.push_back(stages[s]->forward_stage(x, idx));
      x = outputs.back();
    }
    auto loss = stages.back()->loss_from_hidden(outputs.back(), tgt);
    EXPECT_NEAR(loss.item<double>(), ref_loss.item<double>(), 1e-6) << cfg.family;
    loss.backward();
    for (std::size_t s = stages.size() - 1; s-- > 0;) outputs[s].backward(inputs[s + 1].grad());
    for (const auto& item : reference) {
      auto grad = torch::zeros_like(item.value());
      for (auto& st : stages) {
        const auto mine = st->named_parameters();
        if (mine.contains(item.key())) grad += mine[item.key()].grad();
      }
      EXPECT_TRUE(torch::allclose(grad, item.value().grad(), 1e-5, 1e-7)) << cfg.family << " " << item.key();
    }
  }
  // A stage is not the whole model, and its ranges must be blocks of the model.
  auto cfg = GptConfig::preset("tiny");
  Gpt middle(single(), cfg, 1, GptStage{1, 2, false, false});
  EXPECT_THROW(middle->loss(torch::zeros({1, 4}, torch::kLong), torch::zeros({1, 4}, torch::kLong)), InvalidArgument);
  EXPECT_THROW(Gpt(single(), cfg, 1, GptStage{1, 3, false, false}), InvalidArgument);
  EXPECT_THROW(Gpt(single(), cfg, 1, GptStage{1, 1, false, false}), InvalidArgument);
  // With documents a later stage needs the tokens.
  cfg.document_separator = 7;
  Gpt later(single(), cfg, 1, GptStage{1, 2, false, true});
  EXPECT_THROW(later->forward_stage(torch::zeros({1, 4, cfg.d_model})), InvalidArgument);
}

TEST(Gpt, TinyModelLearnsARepeatingSequence) {
  Gpt m(single(), GptConfig::preset("tiny"), 11);
  const NamedParameters params = m->parameter_list();
  AdamWOptions o;
  o.lr = 3e-3;
  auto opt = make_adamw(params, o);
  auto seq = torch::arange(0, 33, torch::kLong).remainder(11).unsqueeze(0).repeat({4, 1}) + 97;
  auto x = seq.slice(1, 0, 32), y = seq.slice(1, 1, 33);
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    opt->zero_grad();
    auto loss = m->loss(x, y);
    loss.backward();
    opt->step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, first * 0.3) << "loss " << first << " -> " << last;
}

TEST(GptConfig, FlopsPerTokenCountsMatmulWeightsAndAttention) {
  // gpt2-124m: 124,475,904 parameters less positions (786,432), norms (38,400) and
  // biases (82,944) leave 123,568,128 matmul weights; attention adds 12*12*768*T.
  const auto c = GptConfig::preset("gpt2-124m");
  EXPECT_DOUBLE_EQ(c.flops_per_token(1024), 6.0 * 123568128 + 12.0 * 12 * 768 * 1024);
  auto qk = c;
  qk.qk_norm = true;  // more (norm) parameters, no more matmul
  EXPECT_GT(qk.num_parameters(), c.num_parameters());
  EXPECT_DOUBLE_EQ(qk.flops_per_token(1024), c.flops_per_token(1024));
  // llama-1b: no biases or positions; 33 RMSNorm weights of 2048.
  const auto l = GptConfig::preset("llama-1b");
  EXPECT_DOUBLE_EQ(l.flops_per_token(2048),
                   6.0 * (1235814400.0 - 33 * 2048) + 12.0 * 16 * 32 * 64 * 2048);
}

TEST(ParallelContext, DegreesMustFitTheWorld) {
  ParallelConfig pc;
  EXPECT_EQ(pc.mesh_axes(6)[1], (std::pair<std::string, int>("dp", 6)));
  pc.dp = 4;
  try {
    pc.mesh_axes(6);
    ADD_FAILURE();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("world has 6"), std::string::npos) << e.what();
  }
  try {
    ParallelContext ctx(make_self_communicator("world", 0), ParallelConfig{0, 1, 1, 1, 1});
    EXPECT_EQ(ctx.dp_size(), 1);
    ParallelContext bad(make_self_communicator("world", 0), ParallelConfig{0, 1, 3, 1, 1});
    ADD_FAILURE() << "pp=3 on one rank accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("world size 1 is not divisible by tp x pp x cp = 3"),
              std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtrain::models
