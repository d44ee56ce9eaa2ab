// Tensor-parallel building blocks over the world as the tp group, against dense
// computations every rank repeats locally: each region function's forward and backward,
// the column/row parallel linear pair (a GELU MLP) with and without sequence parallelism,
// the vocabulary-parallel embedding and cross-entropy (padded vocabularies), and the size
// errors. Tolerance: float32, rtol 1e-5 / atol 1e-6 (sums in another order).
#include <torch/torch.h>

#include "dist_test.hpp"
#include "dtrain/parallel/tensor_parallel.hpp"

namespace dtrain::testing {
namespace {

class TpTest : public DistTest {
 protected:
  // The same tensor on every rank for one seed; per-rank tensors use seed + rank.
  static at::Tensor randn(std::vector<std::int64_t> shape, std::uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    return torch::randn(shape, gen);
  }
  static bool close(const at::Tensor& a, const at::Tensor& b) {
    return a.sizes() == b.sizes() && torch::allclose(a, b, 1e-5, 1e-6);
  }
};

TEST_F(TpTest, RegionFunctionsAndTheirTransposes) {
  const auto tp = world();
  const int n = nranks(), r = rank();
  auto mine = [&](std::vector<std::int64_t> shape, std::uint64_t seed) { return randn(shape, seed + r); };
  auto sum_over_ranks = [&](std::vector<std::int64_t> shape, std::uint64_t seed) {
    auto s = torch::zeros(shape);
    for (int k = 0; k < n; ++k) s += randn(shape, seed + k);
    return s;
  };
  auto cat_over_ranks = [&](std::vector<std::int64_t> shape, std::uint64_t seed, std::int64_t dim) {
    std::vector<at::Tensor> parts;
    for (int k = 0; k < n; ++k) parts.push_back(randn(shape, seed + k));
    return torch::cat(parts, dim);
  };
  // Runs f on x (requires grad), backpropagates g, returns (output, x.grad).
  auto run = [](const at::Tensor& x0, const at::Tensor& g,
                const std::function<at::Tensor(const at::Tensor&)>& f) {
    auto x = x0.clone().requires_grad_();
    auto y = f(x);
    y.backward(g);
    return std::make_pair(y.detach(), x.grad());
  };

  {  // reduce_from_region: sum forward, identity backward.
    auto [y, gx] = run(mine({2, 3, 12}, 100), randn({2, 3, 12}, 7),
                       [&](const at::Tensor& x) { return tp::reduce_from_region(x, tp); });
    EXPECT_TRUE(close(y, sum_over_ranks({2, 3, 12}, 100)));
    EXPECT_TRUE(close(gx, randn({2, 3, 12}, 7)));
  }
  {  // copy_to_region: identity forward, gradients summed.
    auto [y, gx] = run(randn({2, 3, 12}, 5), mine({2, 3, 12}, 200),
                       [&](const at::Tensor& x) { return tp::copy_to_region(x, tp); });
    EXPECT_TRUE(close(y, randn({2, 3, 12}, 5)));
    EXPECT_TRUE(close(gx, sum_over_ranks({2, 3, 12}, 200)));
  }
  {  // scatter_to_region: this rank's slice of the last dim; gradients gathered.
    auto [y, gx] = run(randn({2, 3, 12}, 5), mine({2, 3, 12 / n}, 300),
                       [&](const at::Tensor& x) { return tp::scatter_to_region(x, tp); });
    EXPECT_TRUE(close(y, randn({2, 3, 12}, 5).chunk(n, -1)[r]));
    EXPECT_TRUE(close(gx, cat_over_ranks({2, 3, 12 / n}, 300, -1)));
  }
  {  // gather_from_region: slices concatenated; the (replicated) gradient split.
    auto [y, gx] = run(mine({2, 3, 4}, 400), randn({2, 3, 4 * n}, 8),
                       [&](const at::Tensor& x) { return tp::gather_from_region(x, tp); });
    EXPECT_TRUE(close(y, cat_over_ranks({2, 3, 4}, 400, -1)));
    EXPECT_TRUE(close(gx, randn({2, 3, 4 * n}, 8).chunk(n, -1)[r]));
  }
  {  // reduce_scatter_to_sequence: this rank's sequence slice of the sum; gradients gathered.
    auto [y, gx] = run(mine({2, 12, 5}, 500), mine({2, 12 / n, 5}, 600),
                       [&](const at::Tensor& x) { return tp::reduce_scatter_to_sequence(x, tp, 1); });
    EXPECT_TRUE(close(y, sum_over_ranks({2, 12, 5}, 500).chunk(n, 1)[r]));
    EXPECT_TRUE(close(gx, cat_over_ranks({2, 12 / n, 5}, 600, 1)));
  }
  {  // gather_from_sequence: sequence slices concatenated; gradients reduce-scattered.
    auto [y, gx] = run(mine({2, 3, 5}, 700), mine({2, 3 * n, 5}, 800),
                       [&](const at::Tensor& x) { return tp::gather_from_sequence(x, tp, 1); });
    EXPECT_TRUE(close(y, cat_over_ranks({2, 3, 5}, 700, 1)));
    EXPECT_TRUE(close(gx, sum_over_ranks({2, 3 * n, 5}, 800).chunk(n, 1)[r]));
  }
}

// A GELU MLP, column-parallel then row-parallel, against the dense MLP: outputs and every
// gradient (the layers' slices of the dense weight gradients). With sequence parallelism
// each rank holds a sequence slice of the input and output; the replicated row bias is
// added to a slice, and the layer sums its partial gradients over tp (the dense one).
TEST_F(TpTest, ColumnThenRowParallelMlpMatchesDense) {
  const auto tp = world();
  const int n = nranks(), r = rank();
  const std::int64_t d = 24, h = 36, seq = 12;
  const auto w1 = randn({h, d}, 1) * 0.2, b1 = randn({h}, 2) * 0.1;
  const auto w2 = randn({d, h}, 3) * 0.2, b2 = randn({d}, 4) * 0.1;
  const auto x0 = randn({2, seq, d}, 5), g = randn({2, seq, d}, 6);

  // Dense reference.
  auto dw1 = w1.clone().requires_grad_(), db1 = b1.clone().requires_grad_();
  auto dw2 = w2.clone().requires_grad_(), db2 = b2.clone().requires_grad_();
  auto dx = x0.clone().requires_grad_();
  auto dense = torch::nn::functional::linear(torch::gelu(torch::nn::functional::linear(dx, dw1, db1)), dw2, db2);
  dense.backward(g);

  for (bool sp : {false, true}) {
    tp::ParallelLinearOptions o;
    o.sequence_parallel = sp;
    tp::ColumnParallelLinear col(d, h, tp, o);
    tp::RowParallelLinear row(h, d, tp, o);
    col->load_full(w1, b1);
    row->load_full(w2, b2);
    auto x = (sp ? x0.chunk(n, 1)[r] : x0).clone().requires_grad_();
    auto y = row(torch::gelu(col(x)));
    y.backward(sp ? g.chunk(n, 1)[r].contiguous() : g);
    const auto want_y = sp ? dense.detach().chunk(n, 1)[r] : dense.detach();
    EXPECT_TRUE(close(y.detach(), want_y)) << "sp " << sp;
    EXPECT_TRUE(close(x.grad(), sp ? dx.grad().chunk(n, 1)[r] : dx.grad())) << "sp " << sp;
    EXPECT_TRUE(close(col->weight.grad(), dw1.grad().chunk(n, 0)[r])) << "sp " << sp;
    EXPECT_TRUE(close(col->bias.grad(), db1.grad().chunk(n, 0)[r])) << "sp " << sp;
    EXPECT_TRUE(close(row->weight.grad(), dw2.grad().chunk(n, 1)[r])) << "sp " << sp;
    // Replicated bias: under sequence parallelism the layer sums its partial gradients.
    EXPECT_TRUE(close(row->bias.grad(), db2.grad())) << "sp " << sp;
  }
}

// Row-parallel with a replicated input (split inside) and skip_bias_add; column-parallel
// with gather_output: both equal the dense linear.
TEST_F(TpTest, GatherOutputAndSplitInputMatchDense) {
  const auto tp = world();
  const int n = nranks(), r = rank();
  const auto w = randn({36, 24}, 11), b = randn({36}, 12), x0 = randn({3, 24}, 13);
  const auto dense = torch::nn::functional::linear(x0, w, b);
  tp::ParallelLinearOptions o;
  o.gather_output = true;
  tp::ColumnParallelLinear col(24, 36, tp, o);
  col->load_full(w, b);
  EXPECT_TRUE(close(col(x0).detach(), dense));

  const auto w2 = randn({24, 36}, 14), b2 = randn({24}, 15), x2 = randn({3, 36}, 16);
  o = {};
  o.input_is_parallel = false;
  o.skip_bias_add = true;
  tp::RowParallelLinear row(36, 24, tp, o);
  row->load_full(w2, b2);
  auto x = x2.clone().requires_grad_();
  auto y = row(x);
  EXPECT_TRUE(close(y.detach() + row->bias, torch::nn::functional::linear(x2, w2, b2)));
  y.sum().backward();
  EXPECT_TRUE(close(x.grad(), torch::ones({3, 24}).matmul(w2)));  // gathered from the slices
  EXPECT_EQ(row->weight.size(1), 36 / n);
  (void)r;
}

// The vocabulary-parallel embedding against the dense lookup (vocabulary 10, padded to a
// multiple of tp), and its weight gradient against the dense one's rows.
TEST_F(TpTest, VocabParallelEmbeddingMatchesDense) {
  const auto tp = world();
  const int n = nranks();
  const std::int64_t vocab = 10, dim = 6;
  const auto table = randn({vocab, dim}, 21);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(22);
  const auto ids = torch::randint(0, vocab, {3, 7}, gen, torch::kLong);
  const auto g = randn({3, 7, dim}, 23);
  auto dense_w = table.clone().requires_grad_();
  auto dense = torch::embedding(dense_w, ids);
  dense.backward(g);

  tp::VocabParallelEmbedding emb(vocab, dim, tp);
  EXPECT_EQ(emb->padded_vocab(), tp::padded_vocab_size(vocab, n));
  EXPECT_EQ(emb->padded_vocab() % n, 0);
  emb->load_full(table);
  auto out = emb(ids);
  EXPECT_TRUE(close(out.detach(), dense.detach()));
  out.backward(g);
  // This rank's rows of the dense gradient (zeros for padding rows).
  auto padded_grad = torch::zeros({emb->padded_vocab(), dim});
  padded_grad.narrow(0, 0, vocab).copy_(dense_w.grad());
  const auto rows = emb->padded_vocab() / n;
  EXPECT_TRUE(close(emb->weight.grad(), padded_grad.narrow(0, emb->first_row(), rows)));
}

// Vocabulary-parallel cross-entropy against the dense loss and gradient: the logits of a
// padded vocabulary split across tp, with garbage in the padding columns that must be
// ignored; loss and this rank's columns of the gradient (zero on padding); rows whose
// target is the ignore index (two of five, then all five) as PyTorch leaves them out.
// Both forms: Megatron's (max, sums reduced) and the fused op's (statistics gathered), with
// the collectives each issues; without and with PaLM's z-loss (z lse^2 a row, the dense
// form's lse over the whole vocabulary), which takes no collective of its own.
TEST_F(TpTest, VocabParallelCrossEntropyMatchesDense) {
  const auto tp = world();
  const int n = nranks(), r = rank();
  for (const auto& [fused, z] : {std::make_pair(false, 0.0), std::make_pair(true, 0.0), std::make_pair(false, 0.05),
                                 std::make_pair(true, 0.05)}) {
    SCOPED_TRACE(std::string(fused ? "fused" : "Megatron's") + " z-loss " + std::to_string(z));
    auto vocab_parallel_cross_entropy = [fused = fused, z = z](const at::Tensor& local, const at::Tensor& targets,
                                                               std::int64_t vocab, const CommPtr& c) {
      ops::CrossEntropyOptions o;
      o.z_loss = z;
      return fused ? tp::fused_vocab_parallel_cross_entropy(local, targets, vocab, c, o)
                   : tp::vocab_parallel_cross_entropy(local, targets, vocab, c, -100, z);
    };
    for (std::int64_t vocab : {12, 10, 9}) {
      const std::int64_t padded = tp::padded_vocab_size(vocab, n), cols = padded / n;
      auto full = randn({5, padded}, 31) * 3;
      full.narrow(1, vocab, padded - vocab).fill_(50);  // padding: would dominate if used
      auto gen = at::make_generator<at::CPUGeneratorImpl>(32);
      auto targets = torch::randint(0, vocab, {5}, gen, torch::kLong);
      if (vocab == 10) targets.index_put_({torch::tensor({1, 3})}, -100);
      auto dense_in = full.narrow(1, 0, vocab).clone().requires_grad_();
      const auto kept = targets.ne(-100);
      auto dense = torch::nn::functional::cross_entropy(dense_in, targets) +
                   z * (dense_in.logsumexp(1).square() * kept).sum() / kept.sum();
      dense.backward();

      auto local = full.narrow(1, cols * r, cols).clone().requires_grad_();
      tp::reset_comm_stats();
      auto loss = vocab_parallel_cross_entropy(local, targets, vocab, tp);
      // Megatron's: three all-reduces of [5] float32; the fused: one all-gather of [2, 5]
      // from each rank. None in the backward.
      const double wire = fused ? 8.0 * 5 * (n - 1) : 3 * 4.0 * 5 * 2 * (n - 1) / n;
      EXPECT_EQ(tp::comm_stats().calls, n == 1 ? 0 : fused ? 1 : 3) << "vocab " << vocab;
      EXPECT_DOUBLE_EQ(tp::comm_stats().bytes, wire) << "vocab " << vocab;
      EXPECT_NEAR(loss.item<double>(), dense.item<double>(), 1e-5) << "vocab " << vocab;
      loss.backward();
      EXPECT_EQ(tp::comm_stats().calls, n == 1 ? 0 : fused ? 1 : 3) << "vocab " << vocab;
      auto padded_grad = torch::zeros({5, padded});
      padded_grad.narrow(1, 0, vocab).copy_(dense_in.grad());
      EXPECT_TRUE(close(local.grad(), padded_grad.narrow(1, cols * r, cols))) << "vocab " << vocab;
    }
    {  // every row ignored: 0 and no gradient (PyTorch's mean would be 0 / 0)
      auto local = torch::randn({3, tp::padded_vocab_size(10, n) / n}).requires_grad_();
      auto loss = vocab_parallel_cross_entropy(local, torch::full({3}, -100, torch::kLong), 10, tp);
      EXPECT_EQ(loss.item<double>(), 0.0);
      loss.backward();
      EXPECT_EQ(local.grad().abs().max().item<double>(), 0.0);
    }
    try {
      vocab_parallel_cross_entropy(torch::zeros({5, 7}), torch::zeros({5}, torch::kLong), 100, tp);
      ADD_FAILURE() << "no error";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("is not the padded vocabulary"), std::string::npos) << e.what();
    }
  }
}

// The fused linear form over the split vocabulary (the model's fused_linear_ce at tp > 1):
// the hidden states through the column region (whose backward sums the ranks' shares of
// their gradient) and this rank's rows of a padded head, in chunks of 2, 5 and automatic
// rows (one chunk here), against the dense matmul and loss: the loss, the hidden states'
// gradient, and this rank's rows of the weight's (the padding rows' 0); one all-gather a
// chunk in the forward.
TEST_F(TpTest, VocabParallelLinearCrossEntropyMatchesDense) {
  const auto tp = world();
  const int n = nranks(), r = rank();
  const std::int64_t rows = 7, hid = 4;
  for (std::int64_t vocab : {12, 10, 9}) {
    for (std::int64_t chunk : {2, 5, 0}) {
      const std::int64_t padded = tp::padded_vocab_size(vocab, n), cols = padded / n;
      auto full_w = randn({padded, hid}, 41);
      full_w.narrow(0, vocab, padded - vocab).fill_(20);  // padding: would dominate if used
      const auto hidden = randn({rows, hid}, 42);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(43);
      auto targets = torch::randint(0, vocab, {rows}, gen, torch::kLong);
      if (vocab == 10) targets.index_put_({torch::tensor({1, 3})}, -100);
      auto dense_h = hidden.clone().requires_grad_();
      auto dense_w = full_w.narrow(0, 0, vocab).clone().requires_grad_();
      auto dense = torch::nn::functional::cross_entropy(at::matmul(dense_h, dense_w.t()), targets);
      dense.backward();

      auto h = hidden.clone().requires_grad_();
      auto w = full_w.narrow(0, cols * r, cols).clone().requires_grad_();
      tp::reset_comm_stats();
      auto loss =
          tp::fused_vocab_parallel_linear_cross_entropy(tp::copy_to_region(h, tp), w, targets, vocab, tp, {}, chunk);
      const std::int64_t chunks = chunk == 0 ? 1 : (rows + chunk - 1) / chunk;
      EXPECT_EQ(tp::comm_stats().calls, n == 1 ? 0 : chunks) << "vocab " << vocab << " chunk " << chunk;
      EXPECT_NEAR(loss.item<double>(), dense.item<double>(), 1e-5) << "vocab " << vocab << " chunk " << chunk;
      loss.backward();
      EXPECT_TRUE(close(h.grad(), dense_h.grad())) << "vocab " << vocab << " chunk " << chunk;
      auto padded_grad = torch::zeros({padded, hid});
      padded_grad.narrow(0, 0, vocab).copy_(dense_w.grad());
      EXPECT_TRUE(close(w.grad(), padded_grad.narrow(0, cols * r, cols))) << "vocab " << vocab << " chunk " << chunk;
    }
  }
  try {  // a head that is not this rank's share of the padded vocabulary
    tp::fused_vocab_parallel_linear_cross_entropy(torch::zeros({5, 4}), torch::zeros({7, 4}),
                                                  torch::zeros({5}, torch::kLong), 100, tp);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("fused_vocab_parallel_linear_cross_entropy: 7 columns per rank"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TpTest, SizesThatDoNotDivideAreNamed) {
  const int n = nranks();
  if (n == 1) GTEST_SKIP() << "every size divides tp=1";
  const std::int64_t odd = 2 * n + 1;
  auto e = error_message([&] { tp::ColumnParallelLinear(8, odd, world()); });
  EXPECT_NE(e.find("ColumnParallelLinear out_features=" + std::to_string(odd) +
                   " is not divisible by tp=" + std::to_string(n)), std::string::npos) << e;
  e = error_message([&] { tp::RowParallelLinear(odd, 8, world()); });
  EXPECT_NE(e.find("RowParallelLinear in_features=" + std::to_string(odd)), std::string::npos) << e;
  e = error_message([&] { tp::reduce_scatter_to_sequence(torch::ones({2, odd, 3}), world(), 1); });
  EXPECT_NE(e.find("of size " + std::to_string(odd) + " is not divisible by tp=" + std::to_string(n)),
            std::string::npos) << e;
}

}  // namespace
}  // namespace dtrain::testing
