// The emulator's scheduler (simt.hpp): ucontext fibers, one per thread of the running
// block, a block barrier and one barrier per warp. A fiber runs until it reaches a barrier
// or ends. Warps run one at a time up to each block barrier, in an order that flips every
// phase, so that a missing __syncthreads shows as a wrong result.
#include "simt.hpp"

#include <ucontext.h>

#include <memory>
#include <string>
#include <vector>

namespace dtrain_emu {

uint3 thread_idx{}, block_idx{};
dim3 block_dim{1, 1, 1}, grid_dim{1, 1, 1};

namespace {

constexpr std::size_t kStack = 256 * 1024;
constexpr std::size_t kSlot = 64;  // bytes a lane publishes in one exchange

enum class Wait { kNone, kBlock, kWarp };

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  bool done = false;
  Wait wait = Wait::kNone;
  std::uint64_t gen = 0;
};

struct Barrier {
  std::uint64_t gen = 0;
  int arrived = 0, alive = 0;
  bool arrive() {  // true when this arrival completes the barrier
    if (++arrived < alive) return false;
    arrived = 0;
    ++gen;
    return true;
  }
  void leave() {
    --alive;
    if (arrived > 0 && arrived >= alive) {
      arrived = 0;
      ++gen;
    }
  }
};

struct State {
  std::vector<Fiber> fibers;
  std::vector<Barrier> warps;
  Barrier block;
  ucontext_t scheduler;
  int current = 0;
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> smem;
  std::vector<unsigned char> slots;  // [threads][kSlot]
  std::string error;
};
State s;

void yield() { swapcontext(&s.fibers[s.current].ctx, &s.scheduler); }

void entry() {
  const int me = s.current;
  try {
    (*s.body)();
  } catch (const std::exception& e) {
    if (s.error.empty()) s.error = e.what();
  }
  s.fibers[me].done = true;
  s.block.leave();
  s.warps[me / 32].leave();
  // Returning resumes uc_link, the scheduler.
}

void set_thread(int linear) {
  thread_idx.x = linear % block_dim.x;
  thread_idx.y = (linear / block_dim.x) % block_dim.y;
  thread_idx.z = linear / (block_dim.x * block_dim.y);
}

void run_block(int threads) {
  for (int i = 0; i < threads; ++i) {
    auto& f = s.fibers[i];
    f.done = false;
    f.wait = Wait::kNone;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &s.scheduler;
    makecontext(&f.ctx, entry, 0);
  }
  s.block = Barrier{};
  s.block.alive = threads;
  s.warps.assign((threads + 31) / 32, Barrier{});
  for (int w = 0; w * 32 < threads; ++w) s.warps[w].alive = std::min(32, threads - w * 32);
  // One warp at a time runs until all its threads wait at the block barrier (or end), so
  // that a warp gets ahead of the others as far as the barriers allow; the order of the
  // warps (and of the lanes) flips at every block-barrier phase.
  const int warps = (threads + 31) / 32;
  int remaining = threads;
  bool forward = true;
  auto runnable = [&](int i) {
    const auto& f = s.fibers[i];
    if (f.done) return false;
    if (f.wait == Wait::kBlock) return f.gen != s.block.gen;
    if (f.wait == Wait::kWarp) return f.gen != s.warps[i / 32].gen;
    return true;
  };
  while (remaining > 0) {
    bool progressed = false;
    for (int wk = 0; wk < warps; ++wk) {
      const int w = forward ? wk : warps - 1 - wk;
      const int lanes = std::min(32, threads - w * 32);
      for (bool any = true; any;) {
        any = false;
        for (int lk = 0; lk < lanes; ++lk) {
          const int i = w * 32 + (forward ? lk : lanes - 1 - lk);
          if (!runnable(i)) continue;
          auto& f = s.fibers[i];
          f.wait = Wait::kNone;
          s.current = i;
          set_thread(i);
          swapcontext(&s.scheduler, &f.ctx);
          any = progressed = true;
          if (f.done) --remaining;
        }
      }
    }
    forward = !forward;
    if (!progressed) {
      throw std::runtime_error("emulator: block (" + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) +
                               "," + std::to_string(block_idx.z) + ") deadlocked: some threads wait at a barrier "
                               "others never reach" + (s.error.empty() ? "" : " (after: " + s.error + ")"));
    }
  }
  if (!s.error.empty()) throw std::runtime_error("emulator: a kernel thread threw: " + s.error);
}

}  // namespace

void launch(dim3 grid, dim3 block, std::size_t smem, const std::function<void()>& body) {
  const int threads = static_cast<int>(block.x * block.y * block.z);
  if (threads <= 0 || threads > 1024) throw std::runtime_error("emulator: bad block size");
  grid_dim = grid;
  block_dim = block;
  s.body = &body;
  s.error.clear();
  while (static_cast<int>(s.fibers.size()) < threads) {
    s.fibers.emplace_back();
    s.fibers.back().stack.reset(new char[kStack]);
  }
  s.slots.assign(static_cast<std::size_t>(threads) * kSlot, 0);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        block_idx = {x, y, z};
        s.smem.assign(smem, 0xff);
        run_block(threads);
      }
    }
  }
}

void* dynamic_smem() { return s.smem.data(); }

void sync_threads() {
  auto& f = s.fibers[s.current];
  f.gen = s.block.gen;
  if (s.block.arrive()) return;
  f.wait = Wait::kBlock;
  yield();
}

void sync_warp() {
  auto& f = s.fibers[s.current];
  auto& w = s.warps[s.current / 32];
  f.gen = w.gen;
  if (w.arrive()) return;
  f.wait = Wait::kWarp;
  yield();
}

int lane() { return s.current % 32; }

void warp_exchange(const void* mine, void* out, int src, std::size_t bytes) {
  if (bytes > kSlot) throw std::runtime_error("emulator: exchange too large");
  const int base = s.current / 32 * 32;
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], mine, bytes);
  sync_warp();
  std::memcpy(out, &s.slots[static_cast<std::size_t>(base + (src & 31)) * kSlot], bytes);
  sync_warp();
}

namespace {
float element(std::uint32_t reg, int half, bool bf16) {
  const auto bits = static_cast<unsigned short>(half == 0 ? (reg & 0xffffu) : (reg >> 16));
  if (bf16) {
    std::uint32_t f = static_cast<std::uint32_t>(bits) << 16;
    float v;
    std::memcpy(&v, &f, 4);
    return v;
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
}  // namespace

void mma_m16n8k16(float d[4], const std::uint32_t a[4], const std::uint32_t b[2], const float c[4], bool bf16) {
  struct Frag {
    std::uint32_t a[4], b[2];
  };
  static_assert(sizeof(Frag) <= kSlot, "fragment slot");
  const int base = s.current / 32 * 32;
  Frag mine;
  std::memcpy(mine.a, a, sizeof(mine.a));
  std::memcpy(mine.b, b, sizeof(mine.b));
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], &mine, sizeof(Frag));
  sync_warp();
  // A (16 x 16, row-major): lane l = 4 g + t holds a0: (g, 2t..2t+1), a1: (g+8, 2t..),
  // a2: (g, 2t+8..), a3: (g+8, 2t+8..). B (16 x 8): b0: (k 2t..2t+1, n g), b1: (k 2t+8.., n g).
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    Frag f;
    std::memcpy(&f, &s.slots[static_cast<std::size_t>(base + l) * kSlot], sizeof(Frag));
    const int g = l / 4, t = l % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = element(f.a[0], h, bf16);
      A[g + 8][2 * t + h] = element(f.a[1], h, bf16);
      A[g][2 * t + 8 + h] = element(f.a[2], h, bf16);
      A[g + 8][2 * t + 8 + h] = element(f.a[3], h, bf16);
      B[2 * t + h][g] = element(f.b[0], h, bf16);
      B[2 * t + 8 + h][g] = element(f.b[1], h, bf16);
    }
  }
  sync_warp();
  // C/D (16 x 8): c0, c1: (g, 2t..2t+1); c2, c3: (g+8, 2t..2t+1).
  const int l = s.current - base, g = l / 4, t = l % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float acc = c[i];
    for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];
    d[i] = acc;
  }
}

void ldmatrix_x4(std::uint32_t out[4], const void* row, bool trans) {
  const auto* addr = static_cast<const unsigned char*>(row);
  if ((reinterpret_cast<std::uintptr_t>(addr) & 15) != 0) {
    throw std::runtime_error("emulator: ldmatrix row not 16-byte aligned");
  }
  if (addr < s.smem.data() || addr + 16 > s.smem.data() + s.smem.size()) {
    throw std::runtime_error("emulator: ldmatrix row outside the dynamic shared memory");
  }
  const int base = s.current / 32 * 32, l = s.current - base, g = l / 4, t = l % 4;
  std::memcpy(&s.slots[static_cast<std::size_t>(s.current) * kSlot], &row, sizeof(row));
  sync_warp();
  auto row_of = [&](int m, int r) {  // the 8 elements of row r of matrix m
    const unsigned char* p;
    std::memcpy(&p, &s.slots[static_cast<std::size_t>(base + 8 * m + r) * kSlot], sizeof(p));
    return reinterpret_cast<const std::uint16_t*>(p);
  };
  for (int m = 0; m < 4; ++m) {
    const std::uint16_t lo = trans ? row_of(m, 2 * t)[g] : row_of(m, g)[2 * t];
    const std::uint16_t hi = trans ? row_of(m, 2 * t + 1)[g] : row_of(m, g)[2 * t + 1];
    out[m] = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
  }
  sync_warp();
}

cudaError_t get_last_error() { return cudaSuccess; }
cudaError_t func_set_attribute() { return cudaSuccess; }
cudaError_t get_device(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? 4 : 0;
  return cudaSuccess;
}

}  // namespace dtrain_emu
